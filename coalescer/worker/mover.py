"""The mover: while a reshard runs, moves the keys out of the old shards this node leads.

Each pass over an old shard (one of ``0 .. from - 1``) first puts into their new shards
the bundles a dead mover left in the shard's ``moving`` hash, then raises the shard's
layout marker (``reshard_take.lua``, before the scan: no writer of the old mapping
writes to it any more, not even behind the scan), then scans the shard's keys and takes
every key whose new shard is another, and puts them (``reshard_put.lua``, grouped by new
shard) before deleting the bundles. A running key stays until it finishes (the shard is
not drained while it runs): what its run leaves there (a dead letter, a retry, a re-run)
is taken by a later pass. A pass that finds no key of another shard reports the shard
drained; the report that drains the last old shard ends the reshard, and that mover
raises every shard's marker to the final generation. With ``durability: replicas`` each
take and put counts only once the replicas hold it (else the step fails and is tried
again): a failover never keeps a report of a drained shard while losing the moves it was
made on. See store/layout.py for the whole protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Collection
from typing import TYPE_CHECKING

from coalescer.common.retrying import Backoff, keep_running
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.layout import LayoutInfo, Taken

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

SCAN_COUNT = 500  # keys per HSCAN step, and so at most per take call
BUSY_PAUSE = 0.2  # seconds before another pass over a shard whose keys still run
LOOK_REST = 1.0  # while a reshard runs: how often to look for old shards led now
IDLE_REST = 60.0  # seconds between reads of the layout when no reshard runs (a change wakes it)


class Mover:
    """Drains the old shards this node leads while a reshard runs."""

    def __init__(self, ctx: NodeContext, led: Collection[int]) -> None:
        assert ctx.layouts is not None
        self._layouts = ctx.layouts
        self._node_id = ctx.node_id
        self._led = led
        self._rules = [r.name for r in ctx.rules]
        self._metrics = ctx.metrics
        self._wake = asyncio.Event()
        self._moved: dict[int, int] = defaultdict(int)  # shard -> keys moved, unreported
        self._busy = False

    def poke(self) -> None:
        """The layout changed: look again."""
        self._wake.set()

    async def run(self) -> None:
        """The background loop: survives Redis errors, logs once, backs off."""
        await keep_running("reshard mover", self.step, backoff=Backoff(base=0.2, cap=5.0),
                           logger=log, rest=self._rest,
                           on_error=lambda _: self._metrics.redis_errors.labels("mover").inc())

    def _todo(self, info: LayoutInfo) -> list[int]:
        if not info.resharding:
            return []
        return sorted(n for n in self._led if n < info.source and n not in info.drained)

    async def _rest(self) -> None:
        delay = (BUSY_PAUSE if self._busy else
                 LOOK_REST if self._layouts.info.resharding else IDLE_REST)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
        self._wake.clear()

    async def step(self) -> None:
        """One pass over every old shard this node leads that is not drained yet. The
        layout is read first (whose changes are announced, see node.py) while a reshard
        runs, and once a minute otherwise: an announcement missed costs a minute."""
        self._busy = False
        info = await self._layouts.refresh()
        for shard in self._todo(info):
            if self._layouts.info.gen != info.gen:
                return
            seq = await self._pass(info, shard)
            self._busy = self._busy or seq is None
            if seq is not None:
                await self._raise_tokens(info, shard, seq)
                await self._report(info, shard)

    async def _report(self, info: LayoutInfo, shard: int) -> None:
        moved = self._moved.pop(shard, 0)
        ended = await self._layouts.drained(info.gen, shard, moved)
        log.info("node %s: old shard %d drained (%d keys moved)", self._node_id, shard, moved)
        latest = await self._layouts.refresh()
        if ended:
            await self._layouts.mark_all(self._layouts.keyspace)
            log.info("node %s: reshard from %d to %d shards done", self._node_id,
                     info.source, latest.shards)

    async def _pass(self, info: LayoutInfo, shard: int) -> int | None:
        """Move what ``shard`` holds of other shards. If it held nothing of them, the
        shard's fencing tokens so far (as the pass began), else None."""
        keyspace = info.keyspace(self._layouts.namespace)
        keys = keyspace.shard(shard)
        await self._put_left(keyspace, keys)
        # the shard's marker is raised before the scan: no writer of the old mapping
        # can add a key behind it (the node that began the reshard may not have yet)
        marked = await self._take(keyspace, keys, [])
        if marked is None:
            return None
        clean, cursor, first = True, 0, True
        while first or cursor:
            cursor, found = await self._layouts.scan(keys, cursor, SCAN_COUNT)
            others = [k for k in found if keyspace.shard_of(k) != shard]
            if others:
                taken = await self._take(keyspace, keys, others)
                if taken is None:
                    return None
                await self._put(keyspace, keys, taken)
            clean, first = clean and not others, False
        return marked.seq if clean else None

    async def _raise_tokens(self, info: LayoutInfo, shard: int, seq: int) -> None:
        """Before old shard ``shard`` counts as drained, raise every new shard's fencing
        tokens to its own: a key idle through the reshard (no state to move) and touched
        after it gets a token above every one it got here."""
        keyspace = info.keyspace(self._layouts.namespace)
        await asyncio.gather(*(self._layouts.put(keyspace.shard(n), seq, [], durable=True)
                               for n in range(keyspace.shards) if n != shard))

    async def _take(self, keyspace: KeySpace, keys: ShardKeys,
                    others: list[str]) -> Taken | None:
        dests = [keyspace.shard_of(k) for k in others]
        taken = await self._layouts.take(keys, keyspace.gen, others, dests, self._rules,
                                         durable=True)
        if taken is None:  # the shard follows a newer layout: read it, pass again later
            await self._layouts.refresh()
        return taken

    async def _put_left(self, keyspace: KeySpace, keys: ShardKeys) -> None:
        """Put the bundles a mover that died left behind."""
        left = await self._layouts.moving(keys)
        if not left:
            return
        log.info("node %s: shard %d: putting %d keys a stopped mover left", self._node_id,
                 keys.shard, len(left))
        now = await self._take(keyspace, keys, [])  # the shard's fencing tokens so far
        if now is not None:
            await self._put(keyspace, keys, Taken(now.seq, left))

    async def _put(self, keyspace: KeySpace, keys: ShardKeys, taken: Taken) -> None:
        await self._layouts.carry(keyspace, taken.seq, list(taken.bundles.values()),
                                  durable=True)
        await self._layouts.forget_moved(keys, list(taken.bundles))
        self._moved[keys.shard] += len(taken.bundles)
        self._metrics.reshard_moved.inc(len(taken.bundles))

