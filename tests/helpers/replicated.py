"""A real primary and its replica behind one address that follows the primary.

Clients reach "the primary" through a ``FaultProxy`` on 127.0.0.1; the replica
replicates through a second one (its link). ``cut_replica()`` black-holes the link: the
replica lags, receiving nothing the primary takes from then on. ``fail_over()`` does
what a failover does, with real processes: the primary is SIGKILLed, what its link
still held is dropped (it never reached the replica), the replica is promoted
(``REPLICAOF NO ONE``) and the address moves to it; a new replica of the new primary
is then started, so a deployment that asks for one replica (``durability: replicas:
1``) has it again.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.faults import FaultProxy
from tests.helpers.servers import HOST, ValkeyProcess, poll_until


class ReplicatedRedis:
    """A primary, one replica and its link, and the proxy its clients use (``url``)."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.servers: list[ValkeyProcess] = []  # every one started, stopped by stop()
        self.proxies: list[FaultProxy] = []  # every one running
        try:
            self.primary = self._server([])
            self.proxy = self._proxy(self.primary)
            self.replica, self.link = self._replica()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.proxy.port}/0"

    def cut_replica(self) -> None:
        """Deliver nothing between primary and replica from now on (a partition)."""
        self.link.black_hole()

    def fail_over(self) -> None:
        """SIGKILL the primary, drop what its link held, promote the replica, point the
        address at it, and give it a new replica."""
        self.primary.kill()
        self.link.stop()
        self.proxies.remove(self.link)
        replica = self.replica
        client = replica.client()
        try:
            poll_until(lambda: client.info("replication")["master_link_status"] == "down",
                       message=f"{replica} to lose its primary")
            client.replicaof("NO", "ONE")
        finally:
            client.close()
        self.proxy.retarget(replica.port)
        self.primary = replica
        self.replica, self.link = self._replica()

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for server in self.servers:
            server.stop()

    def _server(self, extra_args: list[str]) -> ValkeyProcess:
        server = ValkeyProcess(dir=self.dir / f"server-{len(self.servers)}",
                               extra_args=extra_args)
        self.servers.append(server)
        return server

    def _proxy(self, server: ValkeyProcess) -> FaultProxy:
        proxy = FaultProxy(server.port).start()
        self.proxies.append(proxy)
        return proxy

    def _replica(self) -> tuple[ValkeyProcess, FaultProxy]:
        """A replica of the primary through a link of its own, started and in sync."""
        primary = self.primary.client()
        try:  # a full sync at once, not after the default 5 s wait for more replicas
            primary.config_set("repl-diskless-sync-delay", 0)
        finally:
            primary.close()
        link = self._proxy(self.primary)
        replica = self._server(["--replicaof", HOST, str(link.port)])
        client = replica.client()
        try:
            poll_until(lambda: client.info("replication")["master_link_status"] == "up",
                       message=f"{replica} in sync with {self.primary}")
        finally:
            client.close()
        return replica, link
