"""The real servers the cases run on, and what a case's ``server`` steps do to them.

``single`` is one valkey-server shared by the cases that leave it as they found it;
``cluster`` a three-master Redis Cluster, shared too (a case's resharding moves a slot
for good, which leaves a valid cluster); ``own`` a server of the case's own, for the
cases that break it (MISCONF, OOM, NOREPLICAS, the eviction policy).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.valkey import Cluster, Server, start_cluster

KINDS = ("single", "cluster", "own")


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


class Servers:
    """Starts each kind of server on first use; ``stop`` stops them all."""

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="conformance-"))
        self._single: Server | None = None
        self._cluster: Cluster | None = None

    def single(self) -> Server:
        if self._single is None:
            self._single = Server(self.root, "single").start()
        return self._single

    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = start_cluster(self.root / "cluster", n_masters=3)
        return self._cluster

    def own(self) -> Server:
        """A new server for one case (the caller stops it): protected configs on, so
        that a case can move its ``dir`` (a failed snapshot), snapshots on."""
        return Server(self.root, "own", ["--enable-protected-configs", "yes",
                                         "--save", "3600 1"]).start()

    def stop(self) -> None:
        for server in (self._single, self._cluster):
            if server is not None:
                server.stop()
        self._single = self._cluster = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


class Target:
    """The servers one case runs on: a URL, and the masters its steps act on."""

    def __init__(self, kind: str, servers: Servers) -> None:
        self.kind = kind
        self.own: Server | None = None
        if kind == "cluster":
            cluster = servers.cluster()
            self.url, self.masters = cluster.url, list(cluster.nodes)
        else:
            self.own = servers.own() if kind == "own" else None
            server = self.own or servers.single()
            self.url, self.masters = server.url, [server]

    @property
    def cluster(self) -> bool:
        return self.kind == "cluster"

    def close(self) -> None:
        if self.own is not None:
            self.own.stop()

    def set_config(self, settings: dict[str, Any]) -> None:
        for server in self.masters:
            with server.client() as admin:
                for name, value in settings.items():
                    admin.config_set(name, value)

    def misconf(self, *, lift: bool) -> None:
        """Make the last snapshot fail (Redis then refuses writes with MISCONF), or
        succeed again."""
        if self.own is None:
            raise ValueError("a misconf step needs servers: own")
        home, gone = self.own.dir, self.own.dir.parent / f"gone-{self.own.port}"
        with self.own.client() as admin:
            if lift:
                admin.config_set("dir", str(home))
            else:
                gone.mkdir(exist_ok=True)
                admin.config_set("dir", str(gone))
                gone.rmdir()  # the snapshot cannot be written: a full or lost disk
            _snapshot(admin, "ok" if lift else "err")


def _snapshot(admin: redis.Redis, expected: str) -> None:
    """BGSAVE, then wait until the last one's status is ``expected``."""
    _wait(lambda: not admin.info("persistence")["rdb_bgsave_in_progress"], "no snapshot")
    admin.bgsave()

    def finished() -> bool:
        info: Any = admin.info("persistence")
        return (not info["rdb_bgsave_in_progress"]
                and info["rdb_last_bgsave_status"] == expected)

    _wait(finished, f"a snapshot with status {expected}")
