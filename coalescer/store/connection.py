"""Redis connections: a single server or a Redis Cluster, detected from one URL.

A node makes one call per shard at a time (upserts, claims, leases), and a
deployment may have up to 16,384 shards, so connections must not grow with the
shard count: script calls travel in a few pipelines at a time (``batching``),
and a single server is reached through a bounded blocking pool (a caller waits
for a free connection, up to ``POOL_TIMEOUT``, instead of failing). A Redis
Cluster's per-node pools have the same bound. A ``redis+sentinel://`` URL names a
master monitored by Redis Sentinel (see sentinel.py): its client follows failovers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.common.redact import redact
from coalescer.store.sentinel import is_sentinel_url, sentinel_client

MAX_CONNECTIONS = 16  # per client (per cluster node): script calls, pub/sub, status, ping
POOL_TIMEOUT = 20.0  # seconds a command waits for a free connection before failing
LEASE_CONNECTIONS = 4  # the leases' own: a node lease call and three claim renewals at once
_WHERE = ("host", "port", "path", "username", "password", "db")  # what a URL says of a server


def _options() -> dict[str, Any]:
    return {
        "decode_responses": True,
        "socket_connect_timeout": 2.0,
        "socket_timeout": 10.0,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        # No health-check PINGs (one per idle connection every 15 s cost an idle node): a command
        # on a dead connection is retried on a new one, and a lost pub/sub connection
        # fails the wake listener's read, which then resubscribes and pokes every shard.
    }


@dataclass(slots=True)
class Connection:
    """The command client (``Redis`` or ``RedisCluster``) and a plain one for pub/sub."""

    url: str
    client: Any
    pubsub_client: Redis
    cluster: bool
    more_pools: list[Any] = field(default_factory=list)  # of bytes_client's clients
    _leases: Any = None  # the leases' own client (see ``leases``)

    def __repr__(self) -> str:
        return f"Connection(url={redact(self.url)!r}, cluster={self.cluster})"

    async def move_to(self, url: str) -> None:
        """Point every client of this single-server connection at ``url``: the embedded
        server serving its folder was replaced (its socket or port). Each connection, the
        ones held by their users too, reconnects there on its next command."""
        if self.cluster or is_sentinel_url(url) or is_sentinel_url(self.url):
            raise ValueError("only a single server's connection can move")
        target = {name: value for name, value in parse_url(url).items()
                  if name in _WHERE}
        for pool in [self.client.connection_pool, *self.more_pools]:
            pool.connection_kwargs.update(target)
            # redis-py keeps no public list of a pool's connections; a connection held
            # by its user (the batcher's senders) would otherwise reconnect to the old port
            for connection in [*pool._available_connections, *pool._in_use_connections]:
                for name, value in target.items():
                    setattr(connection, name, value)
            await pool.disconnect(inuse_connections=True)
        self.url = url

    async def leases(self) -> Any:
        """A client of its own for lease calls, its connections opened now (a renewal
        never waits for a connection behind other calls, nor for a new one's handshake,
        round trips that a slow link makes long)."""
        if self._leases is None:
            if self.cluster:
                self._leases = RedisCluster.from_url(self.url, max_connections=LEASE_CONNECTIONS,
                                                     **_options())
                await self._leases.initialize()
            else:
                self._leases = _server_client(self.url, LEASE_CONNECTIONS, _options())
                self.more_pools.append(self._leases.connection_pool)
            await asyncio.gather(*(self._leases.ping() for _ in range(LEASE_CONNECTIONS)))
        return self._leases

    async def close(self) -> None:
        if self._leases is not None:
            await self._leases.aclose()
        await self.client.aclose()
        if self.pubsub_client is not self.client:
            await self.pubsub_client.aclose()


async def connect(url: str) -> Connection:
    """Connect to ``url``; a node of a Redis Cluster is detected with ``INFO cluster``.

    In a cluster, PUBLISH reaches subscribers on every node, so pub/sub uses a
    plain connection to the node the URL names.
    """
    plain = _server_client(url, MAX_CONNECTIONS, _options())
    try:
        info = await plain.info("cluster")
    except BaseException:
        await plain.aclose()
        raise
    if str(info.get("cluster_enabled", 0)) != "1":
        return Connection(url, plain, plain, cluster=False)
    options = _options()
    cluster = RedisCluster.from_url(url, max_connections=MAX_CONNECTIONS, **options)
    await cluster.initialize()
    return Connection(url, cluster, plain, cluster=True)


def bytes_client(conn: Connection, *, connections: int, read_timeout: float) -> Any:
    """Another client on ``conn``'s server or cluster, answering bytes (not str), with a
    pool of its own of ``connections`` and a socket timeout of ``read_timeout``
    (longer than any blocking read made on it)."""
    options = _options() | {"decode_responses": False, "socket_timeout": read_timeout}
    if conn.cluster:
        return RedisCluster.from_url(conn.url, max_connections=connections, **options)
    client = _server_client(conn.url, connections, options)
    conn.more_pools.append(client.connection_pool)
    return client


def _server_client(url: str, connections: int, options: dict[str, Any]) -> Redis:
    """A client of one server (or of the master a Sentinel URL names) with a bounded,
    blocking pool of ``connections``."""
    if is_sentinel_url(url):
        return sentinel_client(url, max_connections=connections, timeout=POOL_TIMEOUT,
                               options=options)
    pool = BlockingConnectionPool.from_url(url, max_connections=connections,
                                           timeout=POOL_TIMEOUT, **options)
    return Redis.from_pool(pool)
