"""The leader's poller of one shard: event-driven, never a fixed interval (G3).

It claims what is due, then sleeps until the earliest due time or lease expiry
that the claim script reported, capped at ``sleep_cap`` (about a second) so a
lost wake-up never strands work. A nearer due time published by an upsert, a
freed handler slot or a reconnect wakes it early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .keys import ShardKeys
from .runner import Runner
from .scripts import ClaimBatch, Scripts

log = logging.getLogger(__name__)

MAX_CLAIM = 1000  # keys per rule per claim call: each script call stays short
RECOVER_BATCH = 500


class Poller:
    """Claims due keys of one shard while this node leads it."""

    def __init__(self, *, shard: ShardKeys, scripts: Scripts, runner: Runner,
                 rules: Sequence[Any], node_id: str, leader_lease: float, claim_lease: float,
                 wake: asyncio.Event) -> None:
        self._shard = shard
        self._scripts = scripts
        self._runner = runner
        self._rules = list(rules)
        self._node_id = node_id
        self._leader_lease_ms = round(leader_lease * 1000)
        self._claim_lease_ms = round(claim_lease * 1000)
        # About a second, and well inside the lease that each claim call renews.
        self.sleep_cap = min(1.2, leader_lease / 2.5)
        self._wake = wake
        self.starved = False
        self._full = False

    def poke(self) -> None:
        """Wake the poller now (a nearer due time, a freed slot, a reconnect)."""
        self._wake.set()

    async def lead(self, leader_value: str, keep_leading: Callable[[int], bool]) -> None:
        """Poll until the lease is lost (NotLeaderError) or ``keep_leading`` says stop."""
        while True:
            self._wake.clear()
            batch = await self._claim(leader_value)
            if not keep_leading(batch.live_nodes):
                return
            if await self._recover_expired(batch):
                continue
            delay = self._delay(batch)
            self.starved = batch.blocked  # due keys wait for a free slot: poke() wakes us
            if delay > 0:
                await self._sleep(delay)

    async def _claim(self, leader_value: str) -> ClaimBatch:
        limits = [(r.name, min(MAX_CLAIM, self._runner.free_slots(r))) for r in self._rules]
        sent = time.time() * 1000
        batch = await self._scripts.claim(
            self._shard, leader=leader_value, node_id=self._node_id,
            leader_lease_ms=self._leader_lease_ms, claim_lease_ms=self._claim_lease_ms,
            sleep_cap_ms=round(self.sleep_cap * 1000), limits=limits)
        offset = batch.now_ms - (sent + time.time() * 1000) / 2
        for claimed in batch.claims:
            self._runner.start(self._shard.shard, self._rules[claimed.rule_index], claimed, offset)
        self._full = any(
            limit > 0 and sum(1 for c in batch.claims if c.rule_index == i) == limit
            for i, (_, limit) in enumerate(limits))
        return batch

    async def _recover_expired(self, batch: ClaimBatch) -> bool:
        if batch.next_expiry_ms is None or batch.next_expiry_ms > batch.now_ms:
            return False
        names = [r.name for r in self._rules]
        attempts = [r.retry.attempts for r in self._rules]
        n = await self._scripts.recover(self._shard, names, RECOVER_BATCH, attempts)
        if n:
            log.warning("shard %d: %d claims whose holder stopped renewing were re-queued",
                        self._shard.shard, n)
        return n > 0

    def _delay(self, batch: ClaimBatch) -> float:
        """Seconds to sleep: 0 when a claim was cut short by its limit (more is due now)."""
        if self._full:
            return 0.0
        nearest = min((t for t in (batch.next_due_ms, batch.next_expiry_ms) if t is not None),
                      default=None)
        if nearest is None:
            return self.sleep_cap
        # Half a millisecond past the due time: due times are whole milliseconds of the
        # server clock, and waking a hair early would cost a second, empty claim.
        return min(self.sleep_cap, max(0.001, (nearest - batch.now_ms) / 1000 + 0.0005))

    async def _sleep(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)
