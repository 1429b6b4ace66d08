"""pending_bytes.lua, registered once on a client and wrapped by a typed function: a
shard's count of the bytes it holds for its keys (``limits.pending_bytes``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import script_source

PAGE = 500  # meta entries a call reads at most (a count of a big shard takes many calls)
AT_ONCE = 8  # calls in flight at most: each holds a connection of the client's pool


class ByteCount:
    """Counts a shard's bytes a page at a time (see pending_bytes.lua)."""

    def __init__(self, redis: Any, *, items: bool, traces: bool = True,
                 leading: bool = False) -> None:
        """``items``: some rule has items (their sets are measured); ``traces``: trace
        contexts are measured; ``leading``: some rule has ``edge: leading`` (its keys'
        quiet markers are measured)."""
        self._script = redis.register_script(script_source("pending_bytes"))
        self._items = items
        self._traces = traces
        self._leading = leading

    async def count(self, shard: ShardKeys, page: int = PAGE) -> tuple[int, bool]:
        """The shard's bytes (its last full count plus what writes added since), and
        whether a full count ended in this call."""
        args = [shard.items_prefix if self._items else "",
                shard.claimed_prefix if self._items else "",
                shard.traces("") if self._traces else "", page]
        if self._leading:
            args.append(shard.quiet_prefix)
        held, ended = await self._script(keys=[shard.meta, shard.bytes], args=args)
        return int(held), bool(int(ended))

    async def count_all(self, shards: Sequence[ShardKeys]) -> int:
        """The bytes of every one of ``shards`` (see ``count``), ``AT_ONCE`` calls at a
        time."""
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(shard: ShardKeys) -> int:
            async with gate:
                return (await self.count(shard))[0]

        return sum(await asyncio.gather(*(one(shard) for shard in shards)))
