"""The embedded default server: shared, reference-counted, durable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from coalescer.errors import CoalescerError
from coalescer.store.embedded import ENV_REDIS_URL, EmbeddedServer, project_root, resolve_redis_url
from tests.helpers.servers import poll_until

HAS_PROC = Path("/proc/self/cwd").exists()


def _record(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "server.json").read_text())
    return data


def _pid(root: Path) -> int:
    return int(_record(root)["pid"])


def _socket(url: str) -> str:
    return url.rsplit("@", 1)[1].split("?", 1)[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state not in ("Z", "X")


def _servers_in(data_dir: Path) -> list[int]:
    """Pids of live valkey-server processes whose working directory is data_dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"valkey-server" in cmdline and Path(cwd) == data_dir and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _ready_lines(root: Path) -> int:
    return (root / "server.log").read_text().count("Ready to accept connections")


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0)


def _pings(url: str) -> bool:
    client = _client(url)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / ".coalescer"
    yield root
    # Never leave a server behind, whatever the test did.
    try:
        pid = _pid(root)
    except (OSError, ValueError, KeyError):
        return
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_acquire_starts_a_server(root: Path) -> None:
    server = EmbeddedServer(root)
    url = server.acquire()
    try:
        assert url.startswith("unix://:") and url.endswith("/valkey.sock?db=0")
        assert _pings(url)
        record = _record(root)
        assert record["socket"] == _socket(url) == str(root.absolute() / "valkey.sock")
        assert _alive(int(record["pid"]))
        client = _client(url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert Path(str(client.config_get("dir")["dir"])) == (root / "data").resolve()
        client.close()
        assert len(list((root / "users").iterdir())) == 1
    finally:
        server.release()


def test_the_server_has_a_memory_cap_and_never_evicts(root: Path) -> None:
    with EmbeddedServer(root) as url:
        client = _client(url)
        try:
            assert client.config_get("maxmemory") == {"maxmemory": str(1 << 30)}
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        finally:
            client.close()


def test_second_acquire_reuses_and_last_release_stops(root: Path) -> None:
    first, second = EmbeddedServer(root), EmbeddedServer(root)
    url = first.acquire()
    pid = _pid(root)
    assert second.acquire() == url
    assert int(_record(root)["pid"]) == pid
    assert _ready_lines(root) == 1
    if HAS_PROC:
        assert _servers_in((root / "data").resolve()) == [pid]

    first.release()
    assert _alive(pid) and _pings(url), "the server must survive while a user remains"

    second.release()
    assert not _alive(pid), "the last release must stop the server"
    assert not (root / "server.json").exists()
    assert "ready to exit" in (root / "server.log").read_text()
    aof = root / "data" / "appendonlydir"
    assert aof.is_dir() and any(aof.iterdir())


def test_context_manager(root: Path) -> None:
    with EmbeddedServer(root) as url:
        assert _pings(url)
        pid = _pid(root)
    assert not _alive(pid)


def test_data_survives_stop_and_start(root: Path) -> None:
    with EmbeddedServer(root) as url:
        client = _client(url)
        client.set("kept", "yes")
        client.close()
        first_pid = _pid(root)
    assert not _alive(first_pid)
    with EmbeddedServer(root) as url:
        client = _client(url)
        assert client.get("kept") == "yes"
        client.close()
        assert int(_record(root)["pid"]) != first_pid


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("pid_kind", ["dead", "unrelated-live"])
def test_stale_server_json_is_replaced(root: Path, pid_kind: str) -> None:
    root.mkdir(parents=True)
    # A record of a crashed server: nothing on the port; the pid dead, or reused by a
    # live process that is not a valkey-server (ours: it must not be killed).
    stale_pid = _dead_pid() if pid_kind == "dead" else os.getpid()
    (root / "server.json").write_text(
        json.dumps({"socket": str(root / "valkey.sock"), "pid": stale_pid, "run_id": "x" * 40}))
    (root / "users").mkdir()
    (root / "users" / f"{_dead_pid()}.deadbeef").write_text("")
    with EmbeddedServer(root) as url:
        assert _pings(url)
        record = _record(root)
        assert record["pid"] != stale_pid
        assert record["socket"] == _socket(url)
        # The dead user was pruned; only we remain.
        assert len(list((root / "users").iterdir())) == 1
    assert not (root / "server.json").exists()


def test_killed_server_is_replaced(root: Path) -> None:
    holder = EmbeddedServer(root)
    holder.acquire()
    pid = _pid(root)
    os.kill(pid, signal.SIGKILL)
    poll_until(lambda: not _alive(pid), message="SIGKILLed server to exit")
    with EmbeddedServer(root) as url:
        assert _pings(url)
        assert int(_record(root)["pid"]) != pid
        holder.release()
        assert _pings(url), "the other user still holds the new server"


def test_release_without_acquire_is_a_noop(root: Path) -> None:
    EmbeddedServer(root).release()
    assert not (root / "server.json").exists()


_HOLDER = """
import sys
from pathlib import Path
from coalescer.store.embedded import EmbeddedServer
server = EmbeddedServer(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
print(server.acquire(), flush=True)
sys.stdin.readline()
server.release()
print("released", flush=True)
"""


def _spawn_holder(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _hear(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def test_two_processes_acquiring_at_once_share_one_server(root: Path) -> None:
    procs = [_spawn_holder(root) for _ in range(2)]
    try:
        assert [_hear(p) for p in procs] == ["ready", "ready"]
        for proc in procs:  # both go at the same moment
            _say(proc, "go")
        urls = [_hear(p) for p in procs]
        assert urls[0] == urls[1] and urls[0].startswith("unix://:")
        pid = _pid(root)
        assert _ready_lines(root) == 1, "exactly one server was started"
        if HAS_PROC:
            assert _servers_in((root / "data").resolve()) == [pid]
        for proc in procs:
            _say(proc, "release")
        assert [_hear(p) for p in procs] == ["released", "released"]
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
        assert not _alive(pid)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_start_failure_reports_log_tail(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = EmbeddedServer(root)
    original = server._command

    def broken(binary: Path) -> list[str]:
        return [*original(binary), "--no-such-option", "1"]

    monkeypatch.setattr(server, "_command", broken)
    with pytest.raises(CoalescerError, match="no-such-option"):
        server.acquire()
    assert not (root / "server.json").exists()


def test_resolve_redis_url(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_REDIS_URL, "redis://127.0.0.1:1/0")
    assert resolve_redis_url("redis://127.0.0.1:2/0") == ("redis://127.0.0.1:2/0", None)
    assert resolve_redis_url(None) == ("redis://127.0.0.1:1/0", None)
    monkeypatch.delenv(ENV_REDIS_URL)
    monkeypatch.chdir(root.parent)
    url, server = resolve_redis_url(None)
    assert server is not None
    try:
        assert _pings(url)
        assert (root / "server.json").exists()
    finally:
        server.release()
    assert not (root / "server.json").exists()


def test_project_root_is_found_from_the_rules_file(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    config = project / "config"
    config.mkdir(parents=True)
    rules = config / "rules.yaml"
    rules.write_text("rules: []\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the working folder plays no part
    # no .coalescer yet: a new one beside the rules file
    assert project_root(rules) == config / ".coalescer"
    assert project_root(os.path.relpath(rules)) == config / ".coalescer"
    # the nearest ancestor holding one wins ...
    (project / ".coalescer").mkdir()
    assert project_root(rules) == project / ".coalescer"
    # ... and the rules file's own folder is the nearest
    (config / ".coalescer").mkdir()
    assert project_root(rules) == config / ".coalescer"
    # a file named .coalescer is not the server's folder
    (config / ".coalescer").rmdir()
    (config / ".coalescer").write_text("")
    assert project_root(rules) == project / ".coalescer"
    # rules that are not a file (from a string): the search starts in the working folder
    assert project_root("<string>") == elsewhere / ".coalescer"
    monkeypatch.chdir(config)
    assert project_root(None) == project / ".coalescer"


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_folders_and_the_servers_files_are_readable_by_their_owner_only(
        root: Path) -> None:
    root.mkdir(mode=0o755)  # as an older version left it
    root.chmod(0o755)
    server = EmbeddedServer(root)
    url = server.acquire()
    try:
        client = _client(url)
        client.set("k", "v")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.close()
        for folder in (root, root / "data", root / "users"):
            assert _mode(folder) == 0o700, folder
        files = [path for path in (root / "data").rglob("*") if path.is_file()]
        assert any("appendonly" in str(path) for path in files)
        for path in [*files, root / "server.log"]:
            assert _mode(path) & 0o077 == 0, (path, oct(_mode(path)))
    finally:
        server.release()


def test_the_server_asks_for_a_password_kept_in_a_private_file(root: Path) -> None:
    server = EmbeddedServer(root)
    url = server.acquire()
    try:
        password = (root / "password").read_text().strip()
        assert len(password) >= 32 and _mode(root / "password") == 0o600
        assert f":{password}@" in url
        anonymous = redis.Redis(unix_socket_path=_socket(url), socket_timeout=1.0)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        assert _pings(url)
        assert password not in (root / "server.json").read_text()
        if HAS_PROC:
            cmdline = Path(f"/proc/{_pid(root)}/cmdline").read_bytes()
            assert password.encode() not in cmdline, "the password must not be in ps"
    finally:
        server.release()
    with EmbeddedServer(root) as again:
        assert again == url, "a restart keeps the password (and the socket)"


def test_a_server_that_refuses_the_password_is_replaced(root: Path) -> None:
    holder = EmbeddedServer(root)
    url = holder.acquire()
    pid = _pid(root)
    (root / "password").write_text("not-the-servers-password\n")
    try:
        with EmbeddedServer(root) as other:
            assert _pings(other) and other != url
            assert _pid(root) != pid
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- a running coalescer whose embedded server dies -------------------------------------

NODE_RULES = """\
namespace: followed
rules:
  - name: stats
    match: "stats:{id}"
    window: 50ms
    absorb: 10ms
    handler: handlers:refresh
"""
NODE_HANDLERS = """\
seen = []

async def refresh(claim):
    seen.append(claim.key)
"""


def _seen() -> list[str]:
    seen: list[str] = sys.modules["handlers"].seen
    return seen


async def _node(root: Path, rules_file: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from coalescer import Coalescer

    monkeypatch.delenv(ENV_REDIS_URL, raising=False)
    path = rules_file(NODE_RULES, NODE_HANDLERS)
    c = Coalescer.from_yaml(path, embedded_root=root, node_id="n1", grace=1.0)
    await c.start()
    return c


async def _refreshed(c: Any, key: str) -> None:
    from tests.helpers.servers import wait_until

    c.touch(key)
    await wait_until(lambda: key in _seen(), timeout=15, message=f"{key} refreshed")


async def test_a_node_whose_embedded_server_dies_reconnects_to_a_new_one(
        root: Path, rules_file: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    c = await _node(root, rules_file, monkeypatch)
    try:
        await _refreshed(c, "stats:before")
        dead = _pid(root)
        os.kill(dead, signal.SIGKILL)
        poll_until(lambda: not _alive(dead), message="the server to die")
        await _refreshed(c, "stats:after")  # on the server the node started
        assert _pid(root) != dead
        assert _socket(c.redis_url) == _record(root)["socket"]
        assert any("embedded server in" in r.getMessage() and "is gone" in r.getMessage()
                   for r in caplog.records)
    finally:
        await c.close()
    assert not (root / "server.json").exists()  # its last user stopped it


async def test_a_node_moves_to_the_server_another_command_started(
        root: Path, rules_file: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    c = await _node(root, rules_file, monkeypatch)
    try:
        dead = _pid(root)
        os.kill(dead, signal.SIGKILL)
        poll_until(lambda: not _alive(dead), message="the server to die")
        with EmbeddedServer(root) as url:  # e.g. a `coalescer touch` meanwhile
            replacement = _pid(root)
            assert url == c.redis_url  # the same socket in the same folder
        assert replacement != dead
        await _refreshed(c, "stats:after")
        assert _record(root)["pid"] == replacement
    finally:
        await c.close()


def test_the_server_has_no_tcp_port_only_its_private_socket(root: Path) -> None:
    # a TCP port on 127.0.0.1 is reachable by every local user, and once the server dies
    # anyone may bind it and be sent the password
    with EmbeddedServer(root) as url:
        client = _client(url)
        try:
            assert client.config_get("port") == {"port": "0"}
            assert client.config_get("unixsocketperm") == {"unixsocketperm": "700"}
        finally:
            client.close()
        assert _mode(root) == 0o700 and (root / "valkey.sock").is_socket()
        if HAS_PROC:
            inodes = {os.readlink(f"/proc/{_pid(root)}/fd/{fd}")[8:-1]
                      for fd in os.listdir(f"/proc/{_pid(root)}/fd")
                      if os.readlink(f"/proc/{_pid(root)}/fd/{fd}").startswith("socket:")}
            tcp = [row.split()[9] for table in ("/proc/net/tcp", "/proc/net/tcp6")
                   for row in Path(table).read_text().splitlines()[1:]]
            assert not inodes & set(tcp), "the server holds a TCP socket"


_IMPOSTOR = """
import socket, sys, time
tcp, unix = socket.socket(), socket.socket(socket.AF_UNIX)
tcp.bind(("127.0.0.1", 0)); unix.bind(sys.argv[1])
for s in (tcp, unix):
    s.listen(8); s.settimeout(0.05)
print(tcp.getsockname()[1], flush=True)
while True:
    for s in (tcp, unix):
        try:
            s.accept()
        except OSError:
            continue
        open(sys.argv[2], "w").write("a client connected")
"""


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc to tell who listens on a socket")
@pytest.mark.parametrize("pid_kind", ["dead", "reused"])
def test_a_stale_record_never_carries_the_password_anywhere(root: Path, pid_kind: str,
                                                             tmp_path: Path) -> None:
    # after a reboot, the recorded pid is dead, or another process's: one that listens
    # where the record points (a TCP port, a socket outside the folder)
    root.mkdir(parents=True, mode=0o700)
    (root / "password").write_text("the-password-of-this-folder\n")
    heard = tmp_path / "heard"
    impostor = subprocess.Popen([sys.executable, "-c", _IMPOSTOR, str(tmp_path / "else.sock"),
                                 str(heard)], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout is not None
        port = int(impostor.stdout.readline())
        stale_pid = _dead_pid() if pid_kind == "dead" else impostor.pid
        (root / "server.json").write_text(json.dumps(
            {"port": port, "socket": str(tmp_path / "else.sock"), "pid": stale_pid,
             "run_id": "x" * 40}))
        with EmbeddedServer(root) as url:
            assert _pings(url) and _pid(root) != stale_pid
        assert not heard.exists(), "the password was sent where the stale record pointed"
    finally:
        impostor.kill()
        impostor.wait()
