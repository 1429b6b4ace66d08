"""The leader's poller of one shard: event-driven, never a fixed interval.

It claims what is due, then sleeps until the earliest due time or lease expiry
that the claim script reported, capped at ``sleep_cap`` (about a second) so a
lost wake-up never strands work. A nearer due time published by an upsert, a
freed handler slot or a reconnect wakes it early.

Due keys that wait for a handler slot are claimed the moment one frees: the
poller reads the runner's count of freed slots before each claim call, claims
again at once if a slot of a rule that hit its limit freed during the call, and
otherwise sleeps noting those rules, so that the next freed slot of one of them
wakes it. A rule whose slots are all busy never makes it spin. After ``COLLISIONS``
claims in a row that started nothing and got no slot for a rule with due keys while
another shard's claim held them, a poller waits a random pause (at most
``COLLISION_PAUSE``) before each next claim: two shards' pollers never keep claiming in
step, each holding the slots the other needs.

A rule with a rate claims only the starts its token bucket grants (see
``worker.throttle``); its due keys left waiting make the poller sleep until the
bucket holds more, or claim again at once when it may.

A shard with nothing pending or in flight is idle: the poller then sleeps until it is
woken, and a shard with keys pending sleeps until the earliest due time it knows: the
lease is the node's (node_lease.py), so no poller calls Redis to keep it. Its claim call
tells the upsert script when it will look again (the earliest due time, or "never"), so a
touch that becomes due sooner publishes a wake-up; a reconnect of the wake channel pokes
it too, as a message published while the channel was down is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coalescer.errors import ReplicationError
from coalescer.store.fair_args import fair_rules
from coalescer.store.keys import ShardKeys
from coalescer.worker.claims import (
    MAX_CLAIM,
    ClaimBatch,
    claim_into_slots,
    item_rules,
)
from coalescer.worker.lapsed import LapsedClaims, expiry_delay
from coalescer.worker.lease_clock import ServerClock
from coalescer.worker.paused import paused_limits
from coalescer.worker.runner import Runner
from coalescer.worker.throttle import RateGate

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

NEVER_MS = 10 * 365 * 86_400_000  # "the poller looks again" this far ahead: when woken
COLLISION_PAUSE = 0.002  # seconds at most of the random pause before a claim (``_claim``)
COLLISIONS = 50  # collided claims in a row before it: a tenth of a second in step


class Poller:
    """Claims due keys of one shard while this node leads it."""

    def __init__(self, ctx: NodeContext, *, shard: ShardKeys, runner: Runner,
                 hand_over: Callable[[list[int]], bool] = lambda rules: False,
                 others_claiming: Callable[[], bool] = lambda: False) -> None:
        self.shard_keys = shard
        self._shard = shard
        self._scripts = ctx.scripts
        self._runner = runner
        self._rules = list(ctx.rules)
        self._item_rules = item_rules(self._rules)
        self._fair = fair_rules(self._rules)
        self._node_id = ctx.node_id
        leader_lease = ctx.leader_lease
        self._claim_lease_ms = round(ctx.claim_lease * 1000)
        # About a second: how long a poller whose due keys wait for a slot sleeps at most
        self.sleep_cap = min(1.2, leader_lease / 2.5)
        self._wake = asyncio.Event()
        self._freed_at_claim = [0] * len(self._rules)  # the runner's freed() per rule
        self._waiting: list[int] = []  # rules (indices) whose freed slot wakes the sleep
        self._gate = RateGate(ctx, shard=shard.shard, rules=self._rules, slots=runner)
        # this shard's server's clock: the node's own on one server, this shard's (its
        # master's) on a Cluster
        self.clock = ctx.clock if ctx.clock is not None else ServerClock()
        self._lapsed = LapsedClaims(ctx.scripts, shard, self.clock, ctx.claim_lease)
        self._lapse_wait: float | None = None
        self._paused = ctx.paused
        self.served = 0.0  # when a claim of this poller last took slots (monotonic)
        # wakes other shards' pollers waiting for these rules' slots: whether one was
        self._hand_over = hand_over
        self._others_claiming = others_claiming  # another shard's claim call is under way
        self.claiming = False  # a claim call of this poller is under way
        self._got_none = False  # its last claim call got no slot at all
        self._collided = 0  # claims in a row that started nothing, another shard claiming
        self._random = random.Random()

    def poke(self) -> None:
        """Wake the poller now (a nearer due time, a freed slot, a reconnect)."""
        self._wake.set()

    @property
    def waits_for_slots(self) -> bool:
        """Whether due keys of this shard wait, the poller asleep, for a slot to free."""
        return bool(self._waiting)

    def waits_for(self, rules: list[int]) -> bool:
        """Whether this poller sleeps waiting for a slot of one of ``rules`` (indices)."""
        return any(i in self._waiting for i in rules)

    def slots_freed(self) -> None:
        """Slots were freed: wake the poller if due keys of their rules wait for one."""
        if any(self._runner.freed(self._rules[i]) != self._freed_at_claim[i]
               for i in self._waiting):
            self.poke()

    async def lead(self, leader_value: str, keep_leading: Callable[[], bool]) -> None:
        """Poll until the lease is lost (NotLeaderError) or ``keep_leading`` says stop
        (asked before every claim and after it; a ``poke`` wakes the poller to ask)."""
        self._lapsed.restart()
        try:
            while keep_leading():
                if self._collided >= COLLISIONS:
                    await asyncio.sleep(self._random.uniform(0, COLLISION_PAUSE))
                self._wake.clear()
                self._waiting = []
                self._freed_at_claim = [self._runner.freed(r) for r in self._rules]
                try:
                    batch, limited = await self._claim(leader_value)
                except ReplicationError as exc:
                    await self._unconfirmed(exc)
                    continue
                if not keep_leading():
                    return
                if await self._recover_expired(batch):
                    continue
                if not self._claim_again_now(batch, limited):
                    await self._sleep(self._delay(batch))
        finally:
            self._waiting = []
            self._gate.close()

    async def _unconfirmed(self, exc: ReplicationError) -> None:
        """Too few replicas confirmed a claim call (given back, see Scripts.claim): keep
        the shard and try again after ``sleep_cap``. The leadership does not depend on
        replicas (the node's lease is no durable write), so a node left without them
        keeps its shards and says why nothing runs (store/replicas.py), rather than
        handing them to a node that can do no better."""
        log.debug("shard %d: claim not confirmed by the replicas: %s", self._shard.shard,
                  exc)
        self._wake.clear()
        await self._sleep(self.sleep_cap)

    async def _claim(self, leader_value: str) -> tuple[ClaimBatch, list[int]]:
        """One claim call; returns it and the limits of the rules that took that many keys."""
        async def call(limits: list[tuple[str, int]]) -> ClaimBatch:
            limits = paused_limits(self._paused, limits)
            if self._gate:  # rated rules claim only the starts their rate grants
                limits = paused_limits(self._paused, await self._gate.limit(limits))
            return await self._scripts.claim(
                self._shard, leader=leader_value, node_id=self._node_id,
                claim_lease_ms=self._claim_lease_ms,
                sleep_cap_ms=NEVER_MS, limits=limits,
                item_rules=self._item_rules, fair=self._fair)
        crowded = self._others_claiming()
        self.claiming = True
        try:
            batch, limits, taken = await claim_into_slots(
                self._runner, self._shard.shard, self._rules, MAX_CLAIM, call, clock=self.clock)
        finally:
            self.claiming = False
        self._got_none = not any(limits)
        # Every claim call reserves every free slot, even of a rule with nothing due in
        # its shard, until it returns. Two shards' pollers woken together by each
        # other's freed slots can thus keep claiming at the same moments, each call
        # holding the slots the other shard's due keys need, round after round: a hot
        # loop that starts nothing. Once that has gone on for COLLISIONS claims, a random
        # pause before each next claim breaks the step (a pause every time a shard lost a
        # race would make shards claim at uneven rates, and a fair rule's weights drift).
        collided = crowded and not any(taken) and any(limits[i] == 0 for i in batch.held)
        self._collided = self._collided + 1 if collided else 0
        if any(taken):
            self.served = time.monotonic()
        if self._gate:
            await self._gate.settle(batch)
        return batch, [n if t == n else -1 for n, t in zip(limits, taken, strict=True)]

    def _claim_again_now(self, batch: ClaimBatch, limited: list[int]) -> bool:
        """Whether the due keys this claim left can be claimed now; else note what to wait for.

        ``limited[i]`` is rule i's limit if it took that many keys, else -1. A claim
        cut by the per-call cap claims again at once. Keys left because a rule's free
        slots ran out wait for a slot: at once if one freed during the call (unless, with
        a fair rule, another shard's poller waits for one: it was woken as it freed, and
        shards claimed from at even rates keep the fair order across them; it costs
        smaller claim batches), else the sleep waits for ``slots_freed`` (or the capped
        delay).
        """
        if not batch.blocked:
            return False
        if self._gate.retry_now:
            return True
        full = [i for i, n in enumerate(limited) if n >= 0]
        # a fair rule whose groups wait for their cap: a slot it frees wakes the poller
        full += [i for i in batch.held if i not in full]
        if any(limited[i] == MAX_CLAIM for i in full):
            return True
        # a rated rule with no slot to run a claim in at once waits for one too
        full += [i for i in self._gate.slot_bound if i not in full]
        freed = [i for i in full if self._runner.freed(self._rules[i]) != self._freed_at_claim[i]]
        if freed and not (self._fair and self._leaves_slots(freed)):
            return True
        self._waiting = full
        return False

    def _leaves_slots(self, freed: list[int]) -> bool:
        """A fair rule's poller leaves the slots freed during its call to other shards:
        to those waiting for them (woken now), or, when it got no slot at all, to the
        one whose call is under way (it hands them over as it ends). It then waits its
        turn, woken by a slot that frees: shards are claimed from at even rates."""
        return self._hand_over(freed) or (self._got_none and self._others_claiming())

    async def _recover_expired(self, batch: ClaimBatch) -> bool:
        recovered, self._lapse_wait = await self._lapsed.check(
            self._rules, batch.now_ms, batch.next_expiry_ms)
        return recovered

    def _delay(self, batch: ClaimBatch) -> float | None:
        """Seconds to sleep: to the nearest due time or claim lease expiry (at most
        ``sleep_cap`` while due keys wait for a slot); None: until woken."""
        delay = self._due_delay(batch)
        if self._gate.wait is not None:  # due keys wait for their rule's rate
            delay = self._gate.wait + 0.0005 if delay is None else min(
                delay, self._gate.wait + 0.0005)
        return delay

    def _due_delay(self, batch: ClaimBatch) -> float | None:
        # Half a millisecond past the due time: due times are whole milliseconds of the
        # server clock, and waking a hair early would cost a second, empty claim.
        delays = [self.sleep_cap] if batch.blocked else []
        if batch.next_due_ms is not None:
            delays.append(max(0.001, (batch.next_due_ms - batch.now_ms) / 1000 + 0.0005))
        expiry = expiry_delay(batch.now_ms, batch.next_expiry_ms, self._lapse_wait,
                              self.sleep_cap)
        if expiry is not None:
            delays.append(expiry)
        return min(delays, default=None)

    async def _sleep(self, delay: float | None) -> None:
        if delay is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
