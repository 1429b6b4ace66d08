"""Which .coalescer/ the embedded server uses: the search for one stops where another
user could have planted one (a folder of theirs, or one others may write to, such as
/tmp), and after the home folder. The tests run as root: another user is uid 65534."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coalescer.errors import CoalescerError
from coalescer.store.embedded import EmbeddedServer, find_root, project_root
from tests.cli.test_main import cli

OTHER_UID = 65534


def planted(folder: Path) -> Path:
    """A .coalescer/ of another user's in ``folder``, with a password of theirs."""
    root = folder / ".coalescer"
    root.mkdir()
    (root / "password").write_text("the-attackers-password\n")
    for path in (root, root / "password"):
        os.chown(path, OTHER_UID, OTHER_UID)
    return root


def project_in(folder: Path) -> Path:
    project = folder / "project"
    project.mkdir(mode=0o755)
    rules = project / "rules.yaml"
    rules.write_text('rules: [{name: a, match: "*", handler: "json:dumps"}]\n')
    return rules


def test_a_coalescer_folder_planted_in_a_world_writable_parent_is_not_used(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    planted(shared)
    rules = project_in(shared)
    choice = find_root(rules)
    assert choice.root == rules.parent / ".coalescer"
    assert f"{shared} is writable by others" in choice.reason
    assert project_root(rules) == rules.parent / ".coalescer"


def test_the_search_stops_at_a_folder_of_another_user(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    planted(theirs)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    inner = theirs / "mine"
    inner.mkdir(mode=0o755)
    os.chown(inner, os.geteuid(), os.getegid())
    rules = project_in(inner)
    choice = find_root(rules)
    assert choice.root == rules.parent / ".coalescer"
    assert f"{theirs} belongs to another user (uid {OTHER_UID})" in choice.reason


def test_the_search_stops_after_the_home_folder(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".coalescer").mkdir()  # above the home folder: not used
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("HOME", str(home))
    rules = project_in(home)
    choice = find_root(rules)
    assert choice.root == rules.parent / ".coalescer"
    assert f"{home} is your home folder" in choice.reason
    (home / ".coalescer").mkdir()  # the home folder's own is still found
    assert find_root(rules).root == home / ".coalescer"


def test_rules_in_a_world_writable_folder_get_no_embedded_server(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rules = shared / "rules.yaml"
    rules.write_text("rules: []\n")
    with pytest.raises(CoalescerError, match="is writable by others"):
        project_root(rules)
    assert not (shared / ".coalescer").exists()


def test_a_server_folder_of_another_user_is_refused_and_its_password_never_read(
        tmp_path: Path) -> None:
    root = planted(tmp_path)
    with pytest.raises(CoalescerError, match=f"belongs to another user \\(uid {OTHER_UID}\\)"):
        EmbeddedServer(root).acquire()
    assert not (root / "server.json").exists()
    assert oct(root.stat().st_mode & 0o777) == oct(0o755)  # not taken over either


def test_status_verbose_says_which_folder_and_why(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted(shared)
    rules = project_in(shared)
    done = cli("status", "-v", "--rules", str(rules), cwd=rules.parent)
    assert done.returncode == 0, done.stderr
    assert "using the embedded server at" in done.stderr
    assert "chose the folder ./.coalescer: none found from " in done.stderr
    assert f"({shared} is writable by others)" in done.stderr
    assert not (shared / ".coalescer" / "server.json").exists()
