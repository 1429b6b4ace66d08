"""Where `--rules module.path:attribute` is imported from: the environment's sys.path
first; the working folder only last, and only when no other user could write to it. A
package planted in the working folder never shadows the real one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.e2e import clean_env, coalescer_cmd

REAL = '''\
from coalescer import Rule, Rules

RULES = Rules(namespace="{ns}", rules=[Rule(name="real", match="real:{{id}}",
                                            handler="json:dumps")])
'''

PLANTED = '''\
from pathlib import Path

Path({marker!r}).write_text("the planted package ran")
from coalescer import Rule, Rules

RULES = Rules(namespace="{ns}", rules=[Rule(name="planted", match="planted:{{id}}",
                                            handler="json:dumps")])
'''


def _package(folder: Path, name: str, code: str) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("")
    (folder / name / "coalescing.py").write_text(code)


def _check(cwd: Path, value: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*coalescer_cmd(), "check", "--rules", value], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True, timeout=60,
                          check=False)


def test_a_package_planted_in_the_working_folder_never_shadows_the_real_one(
        tmp_path: Path, namespace: str) -> None:
    installed, shared = tmp_path / "site", tmp_path / "shared"
    marker = tmp_path / "planted-ran"
    _package(installed, "shopapp", REAL.format(ns=namespace))
    _package(shared, "shopapp", PLANTED.format(ns=namespace, marker=str(marker)))
    done = _check(shared, "shopapp.coalescing:RULES", PYTHONPATH=str(installed))
    assert done.returncode == 0, done.stderr
    assert "match:    real:{id}" in done.stdout
    assert "planted:{id}" not in done.stdout
    assert not marker.exists(), "the package planted in the working folder was imported"


def test_a_working_folder_others_may_write_to_is_never_imported_from(
        tmp_path: Path, namespace: str) -> None:
    shared = tmp_path / "shared"
    marker = tmp_path / "planted-ran"
    _package(shared, "shopapp", PLANTED.format(ns=namespace, marker=str(marker)))
    os.chmod(shared, 0o1777)  # like /tmp
    done = _check(shared, "shopapp.coalescing:RULES")
    assert done.returncode == 1
    assert not marker.exists(), "the package planted in a shared folder was imported"
    assert done.stderr.splitlines()[0] == (
        "shopapp.coalescing:RULES: cannot import module shopapp.coalescing: No module named "
        f"'shopapp' (looked for on sys.path, then not the working folder, {shared}: it may "
        "be written by other users (install the package, or name its folder in "
        "$PYTHONPATH))")
    # naming the folder is the way to use it anyway
    opted = _check(shared, "shopapp.coalescing:RULES", PYTHONPATH=str(shared))
    assert opted.returncode == 0, opted.stderr
    assert marker.exists()


def test_a_private_working_folder_still_holds_the_apps_package(
        tmp_path: Path, namespace: str) -> None:
    project = tmp_path / "project"
    _package(project, "shopapp", REAL.format(ns=namespace))
    os.chmod(project, 0o755)
    done = _check(project, "shopapp.coalescing:RULES")
    assert done.returncode == 0, done.stderr
    assert "match:    real:{id}" in done.stdout
