"""The embedded server through the real CLI: a project path with a space keeps one live
server, and a stale record whose pid another process now has never gets that process
signalled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_main import (
    cli,
    refreshed,
    start_node,
    stop_node,
    valkey_servers_under,
    write_rules,
)
from tests.helpers.e2e import clean_env
from tests.helpers.servers import ValkeyProcess, poll_until


def _server_pid(project: Path) -> int:
    return int(json.loads((project / ".coalescer" / "server.json").read_text())["pid"])


def test_a_project_path_with_a_space_keeps_one_live_server(
        tmp_path: Path, namespace: str) -> None:
    project = tmp_path / "my project"
    project.mkdir()
    write_rules(project, namespace)
    log = project / "refreshes.log"
    node, out = start_node(project, "--node-id", "n1",
                           env=clean_env(E2E_NODE="n1", E2E_LOG=str(log)))
    try:
        poll_until(lambda: "running" in out.read_text(), timeout=30,
                   message="the node's banner")
        pid = _server_pid(project)
        for key in ("item:1", "item:2"):
            done = cli("touch", key, "--rules", "rules.yaml", cwd=project)
            assert done.returncode == 0, done.stderr
            assert "replacing it" not in done.stderr, done.stderr
            assert _server_pid(project) == pid
            assert valkey_servers_under(project) == [pid]
            poll_until(lambda k=key: refreshed(log, k), timeout=20,  # type: ignore[misc]
                       message=f"the node refreshing {key}; its output:\n{out.read_text()}")
        assert "embedded server in" not in out.read_text()  # the node never moved
    finally:
        assert stop_node(node) == 0
    assert valkey_servers_under(project) == []


def _unrelated(kind: str, folder: Path) -> tuple[int, object]:
    """A live process that is not this project's server: a ``sleep``, or another
    valkey-server (another project's, a system one)."""
    if kind == "sleep":
        proc = subprocess.Popen(["sleep", "600"])
        return proc.pid, proc
    server = ValkeyProcess(dir=folder)
    assert server.pid is not None
    return server.pid, server


def _end(handle: object) -> None:
    if isinstance(handle, ValkeyProcess):
        handle.stop()
    elif isinstance(handle, subprocess.Popen):
        handle.kill()
        handle.wait()


@pytest.mark.parametrize("kind", ["sleep", "valkey-server"])
def test_a_stale_record_whose_pid_was_reused_never_signals_that_process(
        tmp_path: Path, namespace: str, kind: str) -> None:
    project = tmp_path / "project"
    (project / ".coalescer").mkdir(parents=True, mode=0o700)
    rules = write_rules(project, namespace)
    pid, handle = _unrelated(kind, tmp_path)
    try:
        # a record left by a server that died (a reboot): its pid is now another process's
        (project / ".coalescer" / "server.json").write_text(json.dumps(
            {"socket": str(project / ".coalescer" / "valkey.sock"), "pid": pid,
             "started": "1", "run_id": "x" * 40}))
        done = cli("touch", "item:1", "--rules", str(rules), cwd=project)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "touched 1 key\n"
        assert Path(f"/proc/{pid}").exists() and _state(pid) not in "ZX", \
            f"the unrelated {kind} (pid {pid}) was signalled"
    finally:
        _end(handle)
    assert valkey_servers_under(project) == []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


if not sys.platform.startswith("linux"):  # the checks above read /proc
    pytestmark = pytest.mark.skip(reason="needs /proc")
