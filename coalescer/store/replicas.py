"""Whether ``durability: {replicas: N}`` can be met, and what to tell an operator when not
(what the operator sees: docs/durability.md, "When durability cannot be met").

``ReplicationWatch`` follows the WAIT answers of this process's durable calls
(``batching.py``): the first that falls short makes durability unmet, the first that is
met again clears it. The reason counts the primary's connected replicas (``INFO
replication``; on a Redis Cluster, each master's), read when durability becomes unmet
and at most every ``REREAD`` seconds while it stays so. ``coalescer status`` (which
makes no durable write) reads the same counts itself: ``durability_status``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from coalescer.common.plural import noun, plural
from coalescer.config.durability import Durability

log = logging.getLogger(__name__)

REREAD = 5.0  # seconds between two reads of the replica counts while durability is unmet
FIX = "add a replica or lower durability.replicas"

Connected = dict[str, int | None]  # primary's address -> its connected replicas (None: unread)


async def _connected_of(client: Any, **target: Any) -> int | None:
    try:
        info = await client.execute_command("INFO", "replication", **target)
    except (RedisError, OSError) as exc:
        log.debug("INFO replication refused: %r", exc)
        return None
    value = info.get("connected_slaves") if isinstance(info, dict) else None
    return int(value) if value is not None else None


async def read_connected(client: Any) -> Connected:
    """The connected replicas of the primary, or of every master of a Redis Cluster."""
    if isinstance(client, RedisCluster):
        masters = client.get_primaries()
        found = await asyncio.gather(*(_connected_of(client, target_nodes=node)
                                       for node in masters))
        return {node.name: n for node, n in zip(masters, found, strict=True)}
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return {where: await _connected_of(client)}


def _primaries(short: dict[str, int]) -> str:
    if len(short) == 1:
        n = next(iter(short.values()))
        return f"the primary has {plural(n, 'connected replica')}"
    return ", ".join(f"the primary at {where} has {n} connected {noun(n, 'replica')}"
                     for where, n in sorted(short.items()))


def unmet_reason(durability: Durability, connected: Connected,
                 acknowledged: int | None = None) -> str | None:
    """Why ``durability`` is not met, with the fix; None when every primary has enough
    connected replicas and no write fell short (``acknowledged`` None)."""
    wanted = durability.replicas
    if not wanted:
        return None
    waiting = f"waiting for {plural(wanted, 'replica')}"
    short = {w: n for w, n in connected.items() if n is not None and n < wanted}
    if short:
        return f"{waiting}: {_primaries(short)}; {FIX}"
    if acknowledged is None:
        return None
    counts = [n for n in connected.values() if n is not None]
    seen = (f" though the primary has {plural(min(counts), 'connected replica')}"
            if counts else "")
    return (f"{waiting}: only {acknowledged} of {wanted} acknowledged a write within "
            f"{durability.timeout:g}s{seen}; a replica lags or its link is slow, or "
            f"{FIX}")


async def durability_status(client: Any, durability: Durability) -> dict[str, Any]:
    """The ``durability`` entry of ``coalescer status --json``: the replicas asked for,
    each primary's connected replicas (None: unreadable), whether that is too few and
    what to do about it."""
    if not durability.replicas:
        return {"replicas": 0, "connected": {}, "unmet": False, "problem": None}
    connected = await read_connected(client)
    reason = unmet_reason(durability, connected)
    return {"replicas": durability.replicas, "connected": connected,
            "unmet": reason is not None, "problem": reason}


def durability_lines(status: dict[str, Any]) -> list[str]:
    """The warning ``coalescer status`` prints when durability is unmet (else nothing)."""
    reason = (status.get("durability") or {}).get("problem")
    return ["", f"WARNING: durability unmet: {reason}"] if reason else []


class ReplicationWatch:
    """This process's view of its durable writes: ``reason`` is None while they are
    confirmed, else why they are not (see the module)."""

    def __init__(self, client: Any, durability: Durability) -> None:
        self._client = client
        self._durability = durability
        self._on_change: Callable[[bool], None] | None = None
        self.reason: str | None = None
        self._read_at = 0.0
        self._reading: asyncio.Task[None] | None = None

    def listen(self, on_change: Callable[[bool], None]) -> None:
        """Call ``on_change(unmet)`` whenever durability becomes unmet or met again."""
        self._on_change = on_change
        on_change(self.unmet)

    @property
    def unmet(self) -> bool:
        return self.reason is not None

    def confirmed(self) -> None:
        """A durable write was acknowledged by enough replicas."""
        if self.reason is None:
            return
        self.reason = None
        if self._reading is not None:
            self._reading.cancel()
        log.info("durability met again: %s acknowledged writes",
                 plural(self._durability.replicas, "replica"))
        self._changed(False)

    def fell_short(self, acknowledged: int) -> None:
        """A durable write was acknowledged by only ``acknowledged`` replicas in time."""
        first = self.reason is None
        if first:  # said at once; the counts refine it when read
            self.reason = unmet_reason(self._durability, {}, acknowledged)
            self._changed(True)
        idle = self._reading is None or self._reading.done()
        if idle and (first or time.monotonic() - self._read_at >= REREAD):
            self._read_at = time.monotonic()
            self._reading = asyncio.ensure_future(self._explain(acknowledged, first))

    async def _explain(self, acknowledged: int, say: bool) -> None:
        try:
            connected = await read_connected(self._client)
        except (RedisError, OSError) as exc:
            connected = {}
            log.debug("reading the replica counts failed: %r", exc)
        if self.reason is None:
            return  # met again meanwhile
        self.reason = unmet_reason(self._durability, connected, acknowledged)
        if say:
            log.warning("durability unmet: %s; writes and claims wait for them", self.reason)

    def _changed(self, unmet: bool) -> None:
        if self._on_change is not None:
            self._on_change(unmet)

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
