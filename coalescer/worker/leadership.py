"""Leadership of one shard: the leader key names its holder, fenced by epoch. How a
leader key counts while its node's lease lives (``node_lease.py``), how standbys take a
shard over, how shards spread evenly and what a benched node (``health.py``) does:
docs/concepts.md, "Leader lease".

Every lease call also registers this node's rules (see registry.py); a standby
told that the leader lacks some of its rules serves those with its adopter
while it stands by (see adopter.py), asking again once per lease meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coalescer.common.retrying import Backoff, keep_running
from coalescer.errors import NotLeaderError
from coalescer.store.script_types import LeaseState
from coalescer.worker.adopter import Adopter
from coalescer.worker.health import Health
from coalescer.worker.lead_log import LeadLog
from coalescer.worker.node_lease import NodeLease
from coalescer.worker.poller import Poller
from coalescer.worker.registry import encode
from coalescer.worker.wakeups import SUBSCRIBED

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

# A standby at its node's fair share waits this share of the lease before asking for a
# free shard, at most this many times while it stays at its share (then it asks anyway:
# a free shard is never left without a leader for long).
POLITE_SHARE = 0.1
POLITE_ROUNDS = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """What every shard's leadership reads of its node: whether its lease lives (and
    which others do), and whether it is benched."""

    lease: NodeLease
    health: Health | None = None


class Leadership:
    """Runs for one shard: stands by, or leads by running its poller."""

    def __init__(self, ctx: NodeContext, *, poller: Poller, standing: Standing,
                 adopter: Adopter | None = None, lead_log: LeadLog) -> None:
        """Leads the shard of ``poller``; ``lead_log.led`` is the set of shards this
        node leads, which every shard's leadership shares (``lead_log.total``: how
        many shards there are now)."""
        self._shard = poller.shard_keys
        self._scripts = ctx.scripts
        self.poller = poller
        self._node_id = ctx.node_id
        self._lease = ctx.leader_lease
        self._led = lead_log.led
        self._metrics = ctx.metrics
        self.adopter = adopter
        self._rules_entry = encode(ctx.rules)  # this node's rules registry entry
        self._lead_log = lead_log  # the node's one-line summary, not a line per shard
        self.value: str | None = None  # our lease value "EPOCH|NODE-ID" while we hold it
        self.released = asyncio.Event()
        self._node_lease = standing.lease
        self._health = standing.health  # benched (its runs fail): hand back, ask for nothing
        self._yielded = False
        self._yielding = False  # asked to hand the shard back (above the fair share)
        self._lapsed = False  # our node lease lapsed: stop claiming now
        self._take_from = ""  # a holder value whose node's lease lapsed
        self._stopping = False
        self._stop_event = asyncio.Event()
        self._done = asyncio.Event()

    @property
    def shard(self) -> int:
        return self._shard.shard

    @property
    def poller_channel(self) -> str:
        return self._shard.wake_channel

    def stop(self) -> None:
        """Stop claiming now; ``stopped()`` waits until the lease is released."""
        self._stopping = True
        self._stop_event.set()
        self.released.set()
        self.poller.poke()
        if self.adopter is not None:
            self.adopter.poke()

    async def stopped(self) -> None:
        await self._done.wait()

    @property
    def leading(self) -> bool:
        return self._shard.shard in self._led

    def hand_back(self) -> None:
        """Hand the shard back (this node is above its fair share)."""
        if self.leading and not self._yielding:
            self._yielding = True
            self.poller.poke()

    def lapse(self) -> None:
        """Our node lease lapsed: stop claiming now, then ask for the shard again."""
        if self.leading:
            self._lapsed = True
            self.poller.poke()

    def _fair_share(self) -> int:
        """``ceil(shards / live nodes)``, benched nodes left out."""
        live = (self._health.serving_nodes() if self._health is not None
                else self._node_lease.live_nodes)
        return math.ceil(self._lead_log.total / max(1, live))

    def _fit(self) -> bool:
        return self._health is None or self._health.fit.is_set()

    async def run(self) -> None:
        """The background loop: survives Redis errors, logs once, backs off."""
        try:
            await self._loop()
        finally:
            self._done.set()

    async def _loop(self) -> None:
        # Quiet: the lead log sums up the failing shards of the node in one line.
        backoff = Backoff()

        def failed(exc: Exception) -> None:
            self._metrics.redis_errors.labels("leadership").inc()
            self._step_down(forget=False)
            if not backoff.failing:
                self._lead_log.failing(exc)
        await keep_running(f"shard {self._shard.shard}: leadership round", self._led_round,
                           backoff=backoff, logger=log, on_error=failed,
                           stop=lambda: self._stopping, quiet=True)
        await self.release()

    async def _led_round(self) -> None:
        try:
            await self._round()
        except NotLeaderError:
            log.debug("shard %d: lost its leader lease; stopped claiming", self._shard.shard)
            self._lead_log.lost()
            self._step_down(forget=True)

    async def _round(self) -> None:
        if self._yielded:  # just handed this shard back: give the others the first go
            self._yielded = False
            await self._pause(self._lease / 2)
        await self._holding()
        if self._stopping:
            return
        await self._wait_turn()
        if self._stopping:
            return
        self.released.clear()  # before asking: a release announced after it must count
        take_from, self._take_from = self._take_from, ""
        asking = self._lead_log.asking
        asking.add(self._shard.shard)
        try:
            state = await self._scripts.acquire(self._shard, node_id=self._node_id,
                                                lease_ms=round(self._lease * 1000),
                                                mine=self.value or "",
                                                rules=self._rules_entry, take_from=take_from)
        finally:
            asking.discard(self._shard.shard)
        if not state.granted:
            self._step_down(forget=True)
            await self._stand_by(state, asyncio.get_running_loop().time())
            return
        if not self.leading:
            log.debug("shard %d: %s leads (epoch %d)", self._shard.shard, self._node_id,
                      state.epoch)
            if self.adopter is not None:
                self.adopter.stop_serving()
        self.value = state.holder
        self._led.add(self._shard.shard)
        self._metrics.leader.labels(str(self._shard.shard)).set(1)
        self._yielding = self._lapsed = False
        await self.poller.lead(state.holder, self._keep_leading)
        await self._after_lead()

    async def _holding(self) -> None:
        """Wait until this node's lease lives and it is not benched (or the leadership
        stops)."""
        while not self._stopping:
            if not self._node_lease.holding.is_set():
                await self._until(self._node_lease.holding)
            elif self._health is not None and not self._health.fit.is_set():
                await self._until(self._health.fit)
            else:
                return

    async def _until(self, event: asyncio.Event) -> None:
        """Wait until ``event`` is set or the leadership stops."""
        waiter = asyncio.ensure_future(event.wait())
        stop = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.cancel()

    async def _wait_turn(self) -> None:
        """While this node is at its fair share, let the standbys below theirs go first."""
        for _ in range(POLITE_ROUNDS):
            if self._stopping or not self._at_share():
                return
            await self._pause(self._lease * POLITE_SHARE)

    def _at_share(self) -> bool:
        """Whether this node, not leading the shard, already leads (or is asking for) its
        fair share: when a node hands many shards back at once, the standbys below their
        share take them, not the first node to wake (which would hand them back again)."""
        if self.leading or self.value is not None or self._take_from:
            return False
        held = len(self._led) + len(self._lead_log.asking)
        return held >= self._fair_share()

    def _keep_leading(self) -> bool:
        """False once stopping, asked to hand the shard back, our node lease lapsed, or
        this node is benched."""
        return not (self._stopping or self._yielding or self._lapsed) and self._fit()

    async def _after_lead(self) -> None:
        if self._stopping:
            return
        if self._lapsed:  # keep the value: the shard is ours again if nobody took it
            self._lapsed = False
            self._step_down(forget=False)
            return
        if self.value is not None:
            log.debug("shard %d: handing back to rebalance across nodes", self._shard.shard)
            await self._scripts.release(self._shard, value=self.value, node_id=self._node_id,
                                        leave=False)
        self._step_down(forget=True)
        self._yielding = False
        self._yielded = True

    def _step_down(self, *, forget: bool) -> None:
        self._led.discard(self._shard.shard)
        self._metrics.leader.labels(str(self._shard.shard)).set(0)
        if forget:
            self.value = None

    async def _stand_by(self, state: LeaseState, answered: float) -> None:
        """Sleep until the holder's node lease lapses (as read after the acquire call
        that named it, ``answered``), or a release is announced."""
        polite = len(self._led) >= self._fair_share()
        extra = self._lease / 2 if polite else 0.0
        if self.adopter is not None:
            if state.adopt:  # ask again once per lease while serving for the leader
                await self._adopt(state.adopt, self._lease, extra)
                return
            self.adopter.stop_serving()
        holder = state.holder.split("|", 1)[-1]
        while True:
            self._node_lease.watch(holder, self.released)
            await self.released.wait()
            if self._stopping:
                return
            if holder in self._node_lease.live:
                break
            if self._node_lease.lapsed(holder, answered):
                self._take_from = state.holder
                return
            self.released.clear()  # not read since: the watch reads the leases again
        if extra:
            await self._pause(extra)

    async def _adopt(self, names: tuple[str, ...], wait: float, extra: float) -> None:
        """Stand by as ``_stand_by`` does, serving meanwhile the rules the leader lacks."""
        await self._serve_for(names, wait, self.released)
        if extra and not self._stopping:
            await self._serve_for(names, extra, self._stop_event)

    async def _serve_for(self, names: tuple[str, ...], seconds: float,
                         interrupt: asyncio.Event) -> None:
        """Serve ``names`` for ``seconds`` or until ``interrupt``; should the duty end
        sooner, wait out the rest (the next lease call says what to serve)."""
        assert self.adopter is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        await self.adopter.serve(names, seconds, interrupt)
        left = deadline - loop.time()
        if left > 0 and not interrupt.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupt.wait(), left)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), seconds)

    async def release(self) -> None:
        """Give the lease up (clean shutdown), so a standby takes over at once."""
        released = await self._scripts.release(self._shard, value=self.value or "",
                                               node_id=self._node_id, leave=True)
        if released:
            log.debug("shard %d: %s released its lease", self._shard.shard, self._node_id)
        self._step_down(forget=True)

    def on_message(self, data: Any) -> None:
        """A message on the shard's wake channel (or SUBSCRIBED: its subscription began,
        and what was published before it is unheard: look at once)."""
        if data in ("taken", SUBSCRIBED) and self.leading:
            self.poller.poke()  # a claim finds another holder (and stops), or due keys
        elif data in ("released", "taken", SUBSCRIBED):
            self.released.set()
            if self.adopter is not None:
                self.adopter.poke()
        elif self.leading:
            self.poller.poke()
        elif self.adopter is not None:
            self.adopter.poke()
