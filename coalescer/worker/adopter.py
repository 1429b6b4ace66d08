"""Serves, on a shard this node stands by for, the rules that the shard's leader lacks.

In a rolling deploy the nodes of one namespace run different rules files, and
a shard's leader claims only the rules it knows. For each rule it lacks, the
live node with the lowest id that knows it adopts the rule: while standing by
it claims that rule's due keys with ``adopt.lua``, which re-checks the choice
in the same atomic step and claims as the leader does (due keys only, one
fencing token each), so no key is ever held twice. The leader's own rules and
its lease are untouched: leadership never moves because rules differ. An adopted
rule with a rate takes its starts from the rule's bucket, as a poller does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coalescer.config.rules import Rule
from coalescer.errors import ReplicationError
from coalescer.store.fair_args import fair_rules
from coalescer.store.keys import ShardKeys
from coalescer.worker.claims import (
    MAX_CLAIM,
    AdoptBatch,
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


class Adopter:
    """Claims due keys of adopted rules on one shard, event-driven like the poller."""

    def __init__(self, ctx: NodeContext, *, shard: ShardKeys, runner: Runner,
                 sleep_cap: float, clock: ServerClock) -> None:
        """``clock`` is the shard's server clock, as its poller observes it."""
        self._shard = shard
        self._clock = clock
        self._lapsed = LapsedClaims(ctx.scripts, shard, clock, ctx.claim_lease)
        self._lapse_wait: float | None = None
        self._scripts = ctx.scripts
        self._runner = runner
        self._by_name = {r.name: r for r in ctx.rules}
        self._item_rules = item_rules(ctx.rules)
        self._fair = fair_rules(ctx.rules)
        self._node_id = ctx.node_id
        self._claim_lease_ms = round(ctx.claim_lease * 1000)
        self._sleep_cap = sleep_cap
        self._ctx = ctx
        self._wake = asyncio.Event()
        self._serving: tuple[str, ...] = ()
        self.starved = False

    def poke(self) -> None:
        """Wake now (a nearer due time, a freed slot, a release, a stop)."""
        self._wake.set()

    async def serve(self, names: Sequence[str], seconds: float, interrupt: asyncio.Event) -> None:
        """Serve the rules ``names`` for ``seconds``, until ``interrupt`` is set, or until
        this node no longer serves any of them."""
        rules = [self._by_name[n] for n in names if n in self._by_name]
        self._note(tuple(r.name for r in rules))
        deadline = time.monotonic() + seconds
        gate = self._gate(rules)
        self._lapsed.restart()
        try:
            while rules and not interrupt.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.clear()
                freed = [self._runner.freed(r) for r in rules]
                try:
                    batch, full = await self._claim(rules, gate)
                except ReplicationError as exc:  # given back; try again, as the poller does
                    log.debug("shard %d: adopted claim not confirmed by the replicas: %s",
                              self._shard.shard, exc)
                    await self._sleep(min(left, self._sleep_cap))
                    continue
                if batch.served == 0:
                    self._note(())
                    return
                if await self._recover(batch, rules):
                    continue
                self.starved = batch.blocked
                # A slot freed during the claim call found us not yet starved: go again.
                again = full or gate.retry_now or (
                    batch.blocked and freed != [self._runner.freed(r) for r in rules])
                await self._sleep(min(left, 0.0 if again else self._delay(batch, gate)))
        finally:
            self.starved = False
            gate.close()

    def _gate(self, rules: list[Rule]) -> RateGate:
        return RateGate(self._ctx, shard=self._shard.shard, rules=rules, slots=self._runner)

    def stop_serving(self) -> None:
        """This node leads the shard now, or no longer adopts anything there."""
        self._note(())

    def _note(self, serving: tuple[str, ...]) -> None:
        if serving == self._serving:
            return
        if serving:
            log.info("shard %d: %s serves %s %s, which the shard's leader lacks",
                     self._shard.shard, self._node_id, "rule" if len(serving) == 1 else "rules",
                     ", ".join(serving))
        else:
            log.info("shard %d: %s no longer serves rules for the shard's leader",
                     self._shard.shard, self._node_id)
        self._serving = serving

    async def _claim(self, rules: list[Rule], gate: RateGate) -> tuple[AdoptBatch, bool]:
        paused = self._ctx.paused

        async def call(limits: list[tuple[str, int]]) -> AdoptBatch:
            limits = paused_limits(paused, limits)
            if gate:  # rated rules claim only the starts their rate grants
                limits = paused_limits(paused, await gate.limit(limits))
            return await self._scripts.adopt(
                self._shard, node_id=self._node_id, claim_lease_ms=self._claim_lease_ms,
                limits=limits,
                item_rules=self._item_rules, fair=self._fair)
        batch, limits, taken = await claim_into_slots(
            self._runner, self._shard.shard, rules, MAX_CLAIM, call, clock=self._clock)
        if gate:
            await gate.settle(batch)
        full = any(n > 0 and t == n for n, t in zip(limits, taken, strict=True))
        return batch, full

    async def _recover(self, batch: AdoptBatch, rules: list[Rule]) -> bool:
        recovered, self._lapse_wait = await self._lapsed.check(rules, batch.now_ms,
                                                               batch.next_expiry_ms)
        return recovered

    def _delay(self, batch: AdoptBatch, gate: RateGate) -> float:
        delay = self._sleep_cap
        if batch.next_due_ms is not None:
            delay = min(delay, max(0.001, (batch.next_due_ms - batch.now_ms) / 1000 + 0.0005))
        expiry = expiry_delay(batch.now_ms, batch.next_expiry_ms, self._lapse_wait,
                              self._sleep_cap)
        if expiry is not None:
            delay = min(delay, expiry)
        if gate.wait is not None:  # due keys wait for their rule's rate
            delay = min(delay, gate.wait + 0.0005)
        return delay

    async def _sleep(self, delay: float) -> None:
        if delay <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
