"""This node's lease: one per node, however many shards it leads.

Why one lease per node (a shard's leader key never expires and counts while its holder's
node lease lives): docs/concepts.md. A node renews it with one ``node_lease.lua`` call
every ``RENEW_SHARE`` of ``leader_lease`` and learns from the same call every other
node's lease end. Renewals start the periods
of the server clock (multiples of the period), so every node's lease ends at the same
instant. Between calls a node sleeps until its next renewal or until just after the
earliest other lease would lapse: a standby hears of a dead leader within
``LAPSE_MARGIN`` of then, and wakes the shards that wait on that node (``watch``) to take
them over. That second look of a period renews nothing: one plain read of the leases
(``ZRANGE``); only when it shows a lease that lapsed is it read again with the server's
clock (the same script, reading only), and judged from that read.
An idle node makes one renewal and one look a period, however many nodes there are (one
alone: the renewal only). A node that starts (after its first renewal) or shuts down
announces it on the nodes' channel; every node that hears it looks at once, so the
shards are shared again without waiting for a period.

Whether another node's lease lapsed is judged by this node's own clock
(``worker.lease_clock``): only once its lease end has not changed for a full lease as
this node measures time, so a step of the server's clock lapses nothing early. Every
lease call has a deadline of its own (``CALL_SHARE`` of the lease), and this node stops
claiming when its own lease could have lapsed on a timer of its own (``_arm``), never
waiting on a reply that may not come. When recent round trips are long (a slow link), a
renewal goes out early enough for its reply to come back before the lease ends
(``_schedule``): a round trip of a third of the lease keeps it. Nothing else holds a
renewal back: a look gives way to the renewal once it is due, and the start's
announcement goes out apart (a new connection costs a slow link several round trips).
A call that finds this node's lease dropped (another node judged it lapsed) stops claiming too
(``on_lapse``). The live node with the lowest id, when it judges another node's lease
lapsed, drops that node from every shard's node set and rules registry (one
pipeline), then from the leases, while its lease end is still the one read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from coalescer.common.retrying import Backoff, keep_running
from coalescer.store.keys import node_leases, nodes_channel
from coalescer.store.script_types import NodeLeases
from coalescer.worker.lease_clock import ServerClock, Sightings

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

RENEW_SHARE = 0.75  # of the lease: a node's renewal period (an idle node: 0.44 calls/s at 3 s)
SLOW_ROUND_TRIPS = 2.0  # a renewal goes out this many recent round trips before the deadline
RENEW_SLACK = 0.05  # seconds: and this much earlier still
CALL_SHARE = 1.0  # of the lease: how long one lease call may take before it is given up
LAPSE_MARGIN = 0.01  # seconds after another node's lease would lapse before looking again
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
        self._announcing: asyncio.Future[None] | None = None
        self._layouts = ctx.layouts
        self._keyspace = ctx.keyspace
        self._node_id = ctx.node_id
        self._lease = ctx.leader_lease
        self._metrics = ctx.metrics
        self._on_live = on_live
        self._on_lapse = on_lapse
        # the leases' server's clock (the node's own; on a Cluster, the leases' master's)
        self.clock = ctx.clock if ctx.clock is not None else ServerClock()
        self._seen: Sightings[str] = Sightings()  # when each lease end was first read
        self.live: dict[str, float] = {}  # node -> when its lease lapses (loop clock)
        self.holding = asyncio.Event()  # set while this node's lease lives
        self._period_ms = round(self._lease * RENEW_SHARE * 1000)
        self._deadline = 0.0  # loop clock: our lease has ended by then at the latest
        self._expiry: asyncio.TimerHandle | None = None  # stops claiming at the deadline
        self.read_sent = 0.0  # loop clock: when the call that read ``live`` was sent
        self._next = 0.0  # loop clock: when to renew next
        self._round_trip = 0.0  # the longest recent lease call's round trip, decaying
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
        try:
            await keep_running("node lease renewal", self.renew,
                               backoff=Backoff(base=0.05, cap=self._lease / 4), logger=log,
                               on_error=self._failed, rest=self._rest,
                               stop=lambda: self._leaving)
        finally:
            self._disarm()
            if self._announcing is not None:
                self._announcing.cancel()

    async def renew(self) -> None:
        """One call: renew our lease (a look at the others' when the renewal is not due
        and our lease lives), act on what changed."""
        if self._look_suffices():
            try:
                if await self._look():
                    return
            except TimeoutError:  # the renewal is due: it goes out now, the look given up
                log.debug("node %s: a look at the leases outlasted the time to the renewal",
                          self._node_id)
        await self._renew()

    def _look_suffices(self) -> bool:
        """Whether a look does instead of a renewal: our lease lives, and the renewal is
        not due before a recent round trip could bring the look's answer back."""
        return (self.holding.is_set() and not self._leaving
                and asyncio.get_running_loop().time()
                < self._next - max(EARLY, self._round_trip))

    async def _call(self, call: Awaitable[NodeLeases], until: float | None = None
                    ) -> tuple[NodeLeases, float, float]:
        """Make a lease call with a deadline of its own (``until``, loop clock, when
        sooner); observe the server's clock."""
        loop = asyncio.get_running_loop()
        self._wake.clear()  # a watch from now on asks for another call
        sent = loop.time()
        limit = self._lease * CALL_SHARE
        if until is not None:
            limit = min(limit, until - sent)
        state = await asyncio.wait_for(call, limit)
        got = loop.time()
        self.clock.observe(sent, got, state.now_ms)
        self._round_trip = max(got - sent, self._round_trip * 0.9)
        return state, sent, got

    async def _look(self) -> bool:
        """Read every lease, renewing nothing; False (renew instead) when our own lease
        is not in the set. One plain command; when it shows a lease that lapsed, it is
        read again with the server's clock (a script), and judged from that read only.
        A look never holds the renewal back: TimeoutError once the renewal is due."""
        loop = asyncio.get_running_loop()
        self._wake.clear()
        sent = loop.time()
        ends = await asyncio.wait_for(self._scripts.lease_ends(self._key),
                                      min(self._lease * CALL_SHARE, self._next - sent))
        if self._node_id in ends and self._judge(ends, loop.time(), remember=False)[1]:
            state, sent, _ = await self._call(self._scripts.lease_look(self._key),
                                              self._next)
            ends = state.ends
        if self._node_id not in ends:
            return False
        await self._read(ends, sent)
        return True

    async def _renew(self) -> None:
        """The script call: renew our lease, read the others', act on what changed."""
        state, sent, got = await self._call(self._scripts.node_lease(
            self._key, node_id=self._node_id, lease_ms=round(self._lease * 1000),
            period_ms=self._period_ms))
        if state.lapsed and self.holding.is_set():
            log.warning("node %s: its lease was dropped by a node that judged it lapsed; "
                        "stopped claiming and leads again only the shards nobody took",
                        self._node_id)
            self._on_lapse()
        # our lease ends no sooner than this, in the loop's clock: sent before the server ran it
        own = state.ends.get(self._node_id, state.now_ms)
        self._arm(sent + (own - state.now_ms) / 1000)
        self._schedule(state.now_ms, got)
        self.holding.set()
        await self._read(state.ends, sent)
        if not self._announced:  # the others learn of us now, not at their next look
            self._announced = True
            self._announcing = asyncio.ensure_future(self._announce())

    async def _announce(self) -> None:
        """Say on the nodes' channel that this node started: apart from the renewals (on
        a slow link a new connection's round trips would hold the next renewal back);
        should it fail, the next renewal tries again."""
        try:  # no deadline of a lease call's: a new connection may take several round trips
            await self._scripts.client.publish(self.channel, self._node_id)
        except Exception as exc:  # the others will see us at their next look meanwhile
            log.debug("node %s: announcing its start failed: %r", self._node_id, exc)
            self._announced = False

    async def _read(self, ends: dict[str, int], sent: float) -> None:
        """Judge which leases lapsed, by this node's clock; forget the lapsed nodes (one
        node does it: the live one with the lowest id)."""
        live, gone = self._judge(ends, asyncio.get_running_loop().time())
        self.read_sent = sent
        self._set_live(live)
        if gone and self._node_id == min(live, default=self._node_id):
            await self._forget(gone)

    def _judge(self, ends: dict[str, int], now: float, *, remember: bool = True
               ) -> tuple[dict[str, float], list[tuple[str, int]]]:
        """When each live node's lease lapses (loop clock), and the lapsed ones with the
        lease end read. ``remember=False`` leaves the record of first sightings as it was."""
        first = self._seen.see(ends, now) if remember else self._seen.peek(ends, now)
        grace = self._lease + self.clock.margin()
        lease_ms = round(self._lease * 1000)
        live: dict[str, float] = {}
        gone: list[tuple[str, int]] = []
        for node, end in ends.items():
            lapses = self.clock.renewed_at(end - lease_ms, first[node]) + grace
            if node == self._node_id or lapses > now:
                live[node] = lapses
            else:
                gone.append((node, end))
        return live, gone

    def _schedule(self, now_ms: int, got: float) -> None:
        """Renew next at the next period's start (every node's lease then ends at the same
        instant), or sooner when recent round trips would not leave the renewal time to
        get through before our lease ends (node_lease.lua then ends it a lease after it)."""
        start = (now_ms // self._period_ms + 1) * self._period_ms
        soon = self._deadline - SLOW_ROUND_TRIPS * self._round_trip - RENEW_SLACK
        self._next = min(got + (start - now_ms) / 1000 + START_MARGIN, max(got, soon))

    def _arm(self, deadline: float) -> None:
        """Stop claiming at ``deadline`` (loop clock) unless a renewal gets through before:
        on a timer of its own, never waiting on a reply that may not come."""
        self._deadline = deadline
        self._disarm()
        self._expiry = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _disarm(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self._expiry = None
        if self.holding.is_set() and not self._leaving:
            log.warning("node %s: could not renew its lease in time; stopped claiming",
                        self._node_id)
            self.holding.clear()
            self._on_lapse()

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

    async def _forget(self, gone: list[tuple[str, int]]) -> None:
        """Drop lapsed nodes; each call with the lease calls' deadline (this runs in the
        renewal loop: a silent Redis must not hold the next renewal back)."""
        space = self._layouts.keyspace if self._layouts is not None else self._keyspace
        deadline = self._lease * CALL_SHARE
        for node, _ in gone:
            await asyncio.wait_for(self._scripts.forget(space.all_shards(), node), deadline)
            log.info("node %s: forgot node %s, whose lease lapsed", self._node_id, node)
        await asyncio.wait_for(self._scripts.node_lease(
            self._key, node_id=self._node_id, lease_ms=round(self._lease * 1000),
            period_ms=self._period_ms, forgotten=gone), deadline)

    def _failed(self, exc: Exception) -> None:
        """A lease call failed; the expiry timer decides when claiming stops."""
        self._metrics.redis_errors.labels("node_lease").inc()

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
        self._disarm()
        await self._scripts.node_lease(self._key, node_id=self._node_id,
                                       lease_ms=0)
        await self._scripts.client.publish(self.channel, self._node_id)
