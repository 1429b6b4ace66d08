"""The options a printed `coalescer` command gets: --rules unless ./rules.yaml, --redis
unless the URL holds a password or came from the environment, none for the embedded server."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalescer.store.hints import CommandHints


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working folder, holding rules.yaml and conf/other.yaml."""
    (tmp_path / "rules.yaml").write_text("rules: []\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "other.yaml").write_text("rules: []\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_default_rules_on_the_embedded_server_need_no_options(project: Path) -> None:
    for source in ("rules.yaml", "./rules.yaml", str(project / "rules.yaml")):
        hints = CommandHints.of(source, None, environ={})
        assert hints.command("dead retry", "bad:1") == "`coalescer dead retry bad:1`"
        assert hints.note == ""


def test_another_rules_file_is_named_by_its_absolute_path(project: Path) -> None:
    hints = CommandHints.of("conf/other.yaml", None, environ={})
    assert hints.command("dead list") == f"`coalescer dead list --rules {project}/conf/other.yaml`"


def test_a_rules_file_in_another_folder_with_the_default_name_is_named(
        project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("other") / "rules.yaml"
    other.write_text("rules: []\n")
    assert CommandHints.of(str(other), None, environ={}).rules == str(other)


def test_rules_that_are_not_a_file_are_not_named(project: Path) -> None:
    assert CommandHints.of("<rules text>", None, environ={}).rules is None
    assert CommandHints.of(None, None, environ={}).rules is None


def test_a_url_without_a_password_is_given_with_redis(project: Path) -> None:
    hints = CommandHints.of("rules.yaml", "redis://db:6379/0", environ={})
    assert hints.command("dead retry", "a b") == (
        "`coalescer dead retry --redis redis://db:6379/0 'a b'`")
    assert hints.note == ""


@pytest.mark.parametrize("url", ["redis://:pw@db:6379/0", "rediss://user:pw@db",
                                 "unix:///run/redis.sock?password=pw"])
def test_a_url_with_a_password_is_left_to_the_environment_variable(
        project: Path, url: str) -> None:
    hints = CommandHints.of("rules.yaml", url, environ={})
    assert hints.command("dead retry", "k") == "`coalescer dead retry k`"
    assert hints.note == " (with $COALESCER_REDIS_URL set)"


def test_a_url_from_the_environment_variable_is_named_by_it(project: Path) -> None:
    hints = CommandHints.of("rules.yaml", None, environ={"COALESCER_REDIS_URL": "redis://db"})
    assert hints.command("dead retry", "k") == "`coalescer dead retry k`"
    assert hints.note == " (with $COALESCER_REDIS_URL set)"


def test_a_key_that_looks_like_an_option_comes_after_a_double_dash(project: Path) -> None:
    hints = CommandHints.of("rules.yaml", None, environ={})
    assert hints.command("dead retry", "-x:1") == "`coalescer dead retry -- -x:1`"


def test_the_plain_hints_add_nothing() -> None:
    assert CommandHints().command("dead retry", "KEY") == "`coalescer dead retry KEY`"
