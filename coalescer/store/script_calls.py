"""Running the Lua scripts of ``lua/``: each registered once per client, called through
the batcher, the durable ones confirmed by the replicas.

Every atomic step of coalescer is one file in ``lua/``; each opens with a header naming
its KEYS, ARGV and return value. ``_lib.lua`` is prepended to each of them. redis-py's
``register_script`` runs them by SHA and reloads a script that the server lost
(``SCRIPT FLUSH``, a restart, a failover). The typed wrappers build on ``ScriptCalls``
(``claim_scripts.py``, ``write_scripts.py``, ``lease_scripts.py``,
``operator_scripts.py``); ``scripts.py`` joins them into ``Scripts``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

from redis.asyncio.cluster import RedisCluster

from coalescer.config.durability import NO_REPLICAS, Durability
from coalescer.errors import ReplicationError
from coalescer.store.batching import ScriptBatcher
from coalescer.store.replicas import ReplicationWatch

KEY_SEPARATOR = "\0"  # one argument for a batch's keys: far cheaper to encode than many

# The writes that count only once ``durability: replicas`` hold them (batching.py):
# touches (a flush), claims (fencing tokens and in-flight state) and acks.
DURABLE = frozenset({"upsert", "claim", "adopt", "take", "ack"})
LEASE_CALLS = ("node_lease", "renew")  # sent at once, on the leases' own client if given

SCRIPT_NAMES = (
    "upsert", "claim", "ack", "fail", "renew", "recover", "requeue", "acquire", "release",
    "adopt", "peers", "node_lease", "unclaim",
    "purge", "hasten", "take", "take_rate", "cancel",
    "layout", "reshard_begin", "reshard_drained", "reshard_take", "reshard_put", "bench",
    "limits", "run_now", "traces_put", "traces_take",
    "requeue_first", "cancel_scheduled",
)


# helpers only some scripts need, prepended after _lib.lua: the fair order (_fair.lua)
EXTRA_LIBS: dict[str, tuple[str, ...]] = {"claim": ("_fair",), "adopt": ("_fair",)}
EXTRA_LIBS |= {"requeue": ("_requeue",), "requeue_first": ("_requeue",)}  # dead keys back


def script_source(name: str) -> str:
    """The text sent to Redis for script ``name``: the shared helpers, then it. A script
    whose file opens with a ``#!lua flags=...`` line keeps that line first (Redis reads
    flags only there): ``allow-oom`` marks the steps that take work out of Redis or keep
    leases, which must run at ``maxmemory`` under ``noeviction`` (they free about what
    they write), while touches are refused there and stay buffered."""
    folder = resources.files("coalescer.store") / "lua"
    lib = (folder / "_lib.lua").read_text()
    for extra in EXTRA_LIBS.get(name, ()):
        lib += "\n" + (folder / f"{extra}.lua").read_text()
    text = (folder / f"{name}.lua").read_text()
    if text.startswith("#!"):
        shebang, text = text.split("\n", 1)
        return f"{shebang}\n{lib}\n{text}"
    return lib + "\n" + text


def _by_client(scripts: Iterable[Any]) -> dict[Any, list[Any]]:
    by: dict[Any, list[Any]] = {}
    for script in scripts:
        by.setdefault(script.registered_client, []).append(script)
    return by


async def _load(client: Any, sources: list[str]) -> None:
    """SCRIPT LOAD each of ``sources`` on ``client``: one round trip on a single server
    (a pipeline); on a Redis Cluster one after the other, each to every master at once
    (all at once would take more connections than a client's bound)."""
    if isinstance(client, RedisCluster):
        for source in sources:
            await client.script_load(source)
        return
    async with client.pipeline(transaction=False) as pipe:
        for source in sources:
            pipe.script_load(source)
        await pipe.execute()


class ScriptCalls:
    """The registered scripts of one Redis (or Redis Cluster) client, and how a call runs."""

    def __init__(self, redis: Any, durability: Durability = NO_REPLICAS, *,
                 leases: Any = None) -> None:
        """``leases``: a client of its own for the lease calls (``LEASE_CALLS``)."""
        self._redis = redis
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES}
        if leases is not None:
            self._scripts |= {name: leases.register_script(script_source(name))
                              for name in LEASE_CALLS}
        # calls travel in pipelines, never one per shard; DURABLE ones end with WAIT
        self._batcher = ScriptBatcher(redis, durability)
        # whether the durable calls are confirmed now, and why not (store/replicas.py)
        self.replication = ReplicationWatch(redis, durability)
        self._confirming = durability.replicas > 0

    async def preload(self) -> None:
        """Load every script now, on each client at once: a first call would otherwise
        cost three more round trips (NOSCRIPT, then SCRIPT LOAD and the call again),
        which a slow link makes long enough to lose a node's first claims."""
        await asyncio.gather(*(_load(client, [s.script for s in scripts]) for client, scripts
                               in _by_client(self._scripts.values()).items()))

    @property
    def client(self) -> Any:
        """The Redis client the scripts run on (for plain commands next to them)."""
        return self._redis

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._send(name, keys, args, durable=name in DURABLE)

    async def _send(self, name: str, keys: Sequence[str], args: Sequence[Any], *,
                    durable: bool) -> Any:
        try:
            result = await self._batcher.call(self._scripts[name], list(keys), list(args),
                                              durable=durable)
        except ReplicationError as exc:
            self.replication.fell_short(exc.acknowledged)
            raise
        if durable and self._confirming:
            self.replication.confirmed()
        return result

    async def _run_now(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One call sent at once, not queued behind the batcher's (on a Redis Cluster, a
        node's lease renewal would otherwise wait behind its shards' calls, and lapse)."""
        return await self._scripts[name](keys=list(keys), args=list(args))

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any], *,
                   durable: bool = False) -> Any:
        """Run script ``name`` (for the typed wrappers of other modules: store/layout.py);
        ``durable``: confirmed by the replicas as the DURABLE calls are (a reshard's
        mover's moves)."""
        return await self._send(name, keys, args, durable=durable or name in DURABLE)
