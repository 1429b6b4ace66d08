"""This node's lease: one per node, however many shards it leads.

A shard's leader key names its holder and never expires (acquire.lua); it counts while
the holder's node lease lives. So an idle node renews one lease with one script call
(``node_lease.lua``) every three quarters of ``leader_lease``, whatever the number of
shards (on a Redis Cluster the leases key has a tag of its own: one call to one master),
and learns from the same call every other node's lease end. Renewals start the periods
of the server clock (multiples of the period), so every node's lease ends at the same
instant. Between calls a node sleeps until its next renewal or until just after the
earliest other lease would end: a standby hears of a dead leader within
``LAPSE_MARGIN`` of its lease's end, and wakes the shards that wait on that node
(``watch``) to take them over. That second look of a period renews nothing, so it is
no script call but one plain read of the leases (``ZRANGE``, one command where the
renewal is five): which leases ended is judged against the server clock as the last
renewal read it, advanced by the loop's clock from when that renewal answered to when
the look was sent (never later than the server's own clock, so a live lease is never
taken for a lapsed one). An idle node makes one renewal and one look a period, however
many nodes there are (one alone: the renewal only). A node that starts (after its
first renewal) or shuts down announces it on the nodes' channel; every node that hears
it looks at once, so the shards are shared again without waiting for a period.

A call that finds this node's own lease lapsed (the process stalled longer than a
lease), or no call succeeding before the lease ends, tells every led shard to stop
claiming at once (``on_lapse``): another node may be taking them over. The live node
with the lowest id, when a call finds another node's lease lapsed, drops that node from
every shard's node set and rules registry (one pipeline), then from the leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from coalescer.common.retrying import Backoff, keep_running
from coalescer.store.keys import node_leases, nodes_channel

if TYPE_CHECKING:
    from coalescer.worker.node import NodeContext

log = logging.getLogger(__name__)

RENEW_SHARE = 0.75  # of the lease: when a node renews its own (an idle node: 0.44 calls/s)
LAPSE_MARGIN = 0.05  # seconds after another node's lease would end before looking again
START_MARGIN = 0.02  # seconds past a period's start (server clock) before renewing
EARLY = 0.005  # seconds: a wake this close to the renewal renews (no look just before it)


class NodeLease:
    """Renews this node's lease; tells the shards when another node's lease lapsed."""

    def __init__(self, ctx: NodeContext, *, on_live: Callable[[int], None],
                 on_lapse: Callable[[], None]) -> None:
        self._scripts = ctx.scripts
        self._key = node_leases(ctx.keyspace.namespace)
        self.channel = nodes_channel(ctx.keyspace.namespace)
        self._announced = False
        self._layouts = ctx.layouts
        self._keyspace = ctx.keyspace
        self._node_id = ctx.node_id
        self._lease = ctx.leader_lease
        self._metrics = ctx.metrics
        self._on_live = on_live
        self._on_lapse = on_lapse
        self.live: dict[str, float] = {}  # node -> when its lease ends (loop clock)
        self.holding = asyncio.Event()  # set while this node's lease lives
        self._period_ms = round(self._lease * RENEW_SHARE * 1000)
        self._deadline = 0.0  # loop clock: our lease has ended by then at the latest
        self.read_sent = 0.0  # loop clock: when the call that read ``live`` was sent
        self._next = 0.0  # loop clock: when to renew next (the next period's start)
        self._anchor: tuple[float, int] | None = None  # last renewal: (answered, server ms)
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._wake = asyncio.Event()
        self._leaving = False

    @property
    def live_nodes(self) -> int:
        return max(1, len(self.live))

    def lapsed(self, node: str, since: float) -> bool:
        """Whether ``node``'s lease had lapsed at a read sent after ``since`` (loop clock):
        a node missing from an older read may have started since."""
        return node not in self.live and self.read_sent > since

    def watch(self, node: str, event: asyncio.Event) -> None:
        """Set ``event`` once ``node``'s lease has lapsed. A node not live at the last call
        may have started since: the leases are read again at once before it counts as gone."""
        self._watchers.setdefault(node, set()).add(event)
        if node not in self.live:
            self._wake.set()

    async def run(self) -> None:
        """The background loop: survives Redis errors, logs once, backs off."""
        await keep_running("node lease renewal", self.renew,
                           backoff=Backoff(base=0.05, cap=self._lease / 4), logger=log,
                           on_error=self._failed, rest=self._rest,
                           stop=lambda: self._leaving)

    async def renew(self) -> None:
        """One call: renew our lease (a look at the others' when the renewal is not due
        and our lease lives), act on what changed."""
        if self._look_suffices() and await self._look():
            return
        await self._renew()

    def _look_suffices(self) -> bool:
        return (self._anchor is not None and self.holding.is_set() and not self._leaving
                and asyncio.get_running_loop().time() < self._next - EARLY)

    async def _look(self) -> bool:
        """Read every lease with one plain command; False (renew instead) when our own
        lease is not among the live ones."""
        assert self._anchor is not None
        loop = asyncio.get_running_loop()
        self._wake.clear()
        sent = loop.time()
        answered, server_ms = self._anchor
        now_ms = server_ms + int((sent - answered) * 1000)  # at most the server's clock
        ends = await self._scripts.lease_ends(self._key)
        if ends.get(self._node_id, -1) < now_ms:
            return False
        live = {node: answered + (end - server_ms) / 1000
                for node, end in ends.items() if end >= now_ms}
        self.read_sent = sent
        self._set_live(live)
        gone = [node for node, end in ends.items() if end < now_ms]
        if gone and self._node_id == min(live, default=self._node_id):
            await self._forget(gone)
        return True

    async def _renew(self) -> None:
        """The script call: renew our lease, read the others', act on what changed."""
        loop = asyncio.get_running_loop()
        self._wake.clear()  # a watch from now on asks for another call
        sent = loop.time()
        state = await self._scripts.node_lease(self._key, node_id=self._node_id,
                                               lease_ms=round(self._lease * 1000),
                                               period_ms=self._period_ms)
        got = loop.time()
        if state.lapsed and self.holding.is_set():
            log.warning("node %s: its lease lapsed (no renewal for %.1f s); stopped claiming "
                        "and leads again only the shards nobody took", self._node_id,
                        self._lease)
            self._on_lapse()
        # our lease ends no sooner than this, in the loop's clock: sent before the server ran it
        self._deadline = sent + (state.live.get(self._node_id, state.now_ms) - state.now_ms) / 1000
        period = self._period_ms
        start = (state.now_ms // period + 1) * period
        self._next = got + (start - state.now_ms) / 1000 + START_MARGIN
        self.holding.set()
        self._anchor = (got, state.now_ms)
        live = {node: got + (ends - state.now_ms) / 1000 for node, ends in state.live.items()}
        self.read_sent = sent
        self._set_live(live)
        if state.gone and self._node_id == min(live, default=self._node_id):
            await self._forget(state.gone)  # one node does it: the live one with the lowest id
        if not self._announced:  # the others learn of us now, not at their next look
            await self._scripts.client.publish(self.channel, self._node_id)
            self._announced = True

    def poke(self, node: str) -> None:
        """``node`` announced that it joined or left: read the leases at once."""
        if node != self._node_id:
            self._wake.set()

    def _set_live(self, live: dict[str, float]) -> None:
        counted = len(live) != len(self.live)
        self.live = live
        for node in [n for n in self._watchers if n not in live]:
            for event in self._watchers.pop(node):
                event.set()
        if counted:
            self._on_live(self.live_nodes)

    async def _forget(self, gone: list[str]) -> None:
        space = self._layouts.keyspace if self._layouts is not None else self._keyspace
        for node in gone:
            await self._scripts.forget(space.all_shards(), node)
            log.info("node %s: forgot node %s, whose lease lapsed", self._node_id, node)
        await self._scripts.node_lease(self._key, node_id=self._node_id,
                                       lease_ms=round(self._lease * 1000),
                                       period_ms=self._period_ms, forgotten=gone)

    def _failed(self, exc: Exception) -> None:
        self._metrics.redis_errors.labels("node_lease").inc()
        if self.holding.is_set() and asyncio.get_running_loop().time() >= self._deadline:
            log.warning("node %s: could not renew its lease; stopped claiming", self._node_id)
            self.holding.clear()
            self._on_lapse()

    async def _rest(self) -> None:
        """Until our next renewal, or just after the earliest other lease would end."""
        loop = asyncio.get_running_loop()
        others = [ends + LAPSE_MARGIN for node, ends in self.live.items()
                  if node != self._node_id]
        delay = min([self._next, *others]) - loop.time()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def leave(self) -> None:
        """Drop our lease (a clean shutdown, after every shard was released)."""
        self._leaving = True
        self._wake.set()
        self.holding.clear()
        await self._scripts.node_lease(self._key, node_id=self._node_id,
                                       lease_ms=0)
        await self._scripts.client.publish(self.channel, self._node_id)
