"""A small launcher of real valkey-server processes for the benchmarks (127.0.0.1 only).

Each figure gets a fresh server: no persistence, nothing shared between figures.
Also: a local Redis Cluster of such servers (used by the bench and by the tests), a
MONITOR-based counter of the commands clients send (script-internal calls excluded)
and helpers reading INFO.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import redis

from coalescer.store.embedded import server_binary

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """One valkey-server child process; ``with Server(dir) as s:`` starts and stops it."""

    def __init__(self, root: Path, name: str = "valkey", extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.dir = Path(root) / f"{name}-{self.port}"
        self.extra_args = list(extra_args)  # after the defaults, so they override them
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def client(self, timeout: float = 30.0) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, decode_responses=True,
                           socket_timeout=timeout, socket_connect_timeout=5.0)

    def start(self) -> Server:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = (self.dir / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [str(server_binary()), "--port", str(self.port), "--bind", HOST,
             "--save", "", "--appendonly", "no", "--dir", str(self.dir),
             "--protected-mode", "yes", *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with self.client(timeout=0.5) as c:
                    if c.ping():
                        return self
            except (redis.RedisError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"valkey-server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# -- a local Redis Cluster ----------------------------------------------------------------


TOTAL_SLOTS = 16384


class Cluster:
    """A local Redis Cluster of real valkey-server masters (no replicas), on 127.0.0.1."""

    def __init__(self, nodes: list[Server]) -> None:
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

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Cluster(ports={self.ports})"


def start_cluster(base_dir: Path, n_masters: int = 3, timeout: float = 30.0) -> Cluster:
    """Start ``n_masters`` cluster-enabled servers, join and slot them, wait until ok."""
    cluster = Cluster([])
    try:
        bus_ports = []
        for _ in range(n_masters):
            node, bus_port = _cluster_node(Path(base_dir))
            cluster.nodes.append(node.start())
            bus_ports.append(bus_port)
        _join_and_assign(cluster.nodes, bus_ports)
        for node in cluster.nodes:
            _wait(partial(_cluster_ready, node, n_masters), timeout,
                  f"cluster_state:ok on port {node.port}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _cluster_node(base_dir: Path) -> tuple[Server, int]:
    node = Server(base_dir, "node")
    bus_port = free_port()
    while bus_port == node.port:
        bus_port = free_port()
    node.extra_args = ["--cluster-enabled", "yes",
                       "--cluster-config-file", f"nodes-{node.port}.conf",
                       "--cluster-port", str(bus_port), "--cluster-node-timeout", "5000"]
    return node, bus_port


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def _execute(client: redis.Redis, *args: Any) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _slot_ranges(n: int) -> list[tuple[int, int]]:
    """16384 slots split as evenly as possible into n inclusive ranges."""
    bounds = [TOTAL_SLOTS * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


def _join_and_assign(nodes: list[Server], bus_ports: list[int]) -> None:
    with nodes[0].client(timeout=5.0) as first:
        for node, bus_port in zip(nodes[1:], bus_ports[1:], strict=True):
            _execute(first, "CLUSTER", "MEET", HOST, node.port, bus_port)
    for node, (low, high) in zip(nodes, _slot_ranges(len(nodes)), strict=True):
        with node.client(timeout=5.0) as client:
            _execute(client, "CLUSTER", "ADDSLOTSRANGE", low, high)


def _cluster_ready(node: Server, n: int) -> bool:
    try:
        with node.client(timeout=5.0) as client:
            info = _execute(client, "CLUSTER", "INFO")
            nodes_text = _execute(client, "CLUSTER", "NODES")
    except (redis.RedisError, OSError):
        return False
    if isinstance(info, str):
        info = dict(line.split(":", 1) for line in info.split() if ":" in line)
    lines = nodes_text.splitlines() if isinstance(nodes_text, str) else list(nodes_text)
    connected = [line for line in map(str, lines) if " connected" in line]
    return (str(info.get("cluster_state")) == "ok"
            and int(info.get("cluster_known_nodes", 0)) == n
            and int(info.get("cluster_slots_ok", 0)) == TOTAL_SLOTS
            and len(connected) == n)


# -- INFO -----------------------------------------------------------------------------------


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def commandstats(client: redis.Redis, field: str = "calls") -> dict[str, int]:
    """Calls (or ``field="usec"``: microseconds spent) per command since the last CONFIG
    RESETSTAT, script-internal calls included."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v[field]) for name, v in stats.items()}


def calls_delta(before: dict[str, int], after: dict[str, int],
                ignore: tuple[str, ...] = ("info", "config|resetstat")) -> dict[str, int]:
    out = {}
    for name, calls in after.items():
        d = calls - before.get(name, 0)
        if d and name not in ignore:
            out[name] = d
    return out


class MonitorCounter:
    """Records the commands every other client sends, by MONITOR, in a thread.

    MONITOR stamps each command with the server's time; ``count(t0, t1)`` counts
    those stamped inside a window. A line MONITOR tags ``[N lua]`` is a call made
    inside a script: counted apart (``nested``), so ``top`` is what clients send.
    """

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection((HOST, port), timeout=5.0)
        self._sock.sendall(b"MONITOR\r\n")
        self._seen: list[tuple[float, bool, str]] = []
        self._stop = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="monitor")
        self._thread.start()
        if not self._ready.wait(5.0):
            raise RuntimeError("MONITOR did not answer")

    def _read(self) -> None:
        buf = b""
        self._sock.settimeout(0.2)
        while not self._stop:
            try:
                chunk = self._sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\r\n")
            for line in lines:
                self._line(line)

    def _line(self, line: bytes) -> None:
        if line == b"+OK":
            self._ready.set()
            return
        head = line[:160]
        try:
            ts = float(head[1:head.index(b" ")])
        except ValueError:
            return
        quote = head.find(b'] "')
        end = head.find(b'"', quote + 3)
        name = head[quote + 3:end].decode(errors="replace").lower() if quote >= 0 else "?"
        self._seen.append((ts, b" lua]" in head[:quote + 1], name))

    def count(self, t0: float, t1: float, settle: float = 0.3) -> dict[str, Any]:
        """Commands stamped in [t0, t1] (epoch seconds): top-level, nested, by command."""
        time.sleep(settle)  # lines the server already sent arrive
        top = nested = 0
        by_command: dict[str, int] = {}
        for ts, is_nested, name in list(self._seen):
            if not t0 <= ts <= t1:
                continue
            if is_nested:
                nested += 1
            else:
                top += 1
                by_command[name] = by_command.get(name, 0) + 1
        return {"top": top, "nested": nested, "by_command": by_command}

    def close(self) -> None:
        self._stop = True
        self._thread.join(2.0)
        self._sock.close()


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds the server has used (user + system)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
