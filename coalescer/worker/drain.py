"""Drain: run everything pending now through this process's handlers, windows skipped
(``Coalescer.drain`` says what a user gets). Each round reads the rules file's sources
once up to now (``read_sources``, lent by the façade: the worker layer never imports the
sources), flushes this process's touches, makes every pending key of the coalescer's
rules due now (``hasten.lua``), re-queues claims whose holder died, and claims what is
due (``take.lua``: as the leader's poller claims, whoever leads the shard) into this
process's runner, within each rule's concurrency (a key not yet started stays pending
in Redis). It ends once a round finds nothing pending or in flight for the coalescer's
rules and nothing ran since the round before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coalescer.claim import Claim
from coalescer.worker.claims import MAX_CLAIM, RECOVER_BATCH, Taken, claim_into_slots, item_rules
from coalescer.worker.invoke import Invoke
from coalescer.worker.runner import Runner

# Reads the sources once up to now, by a deadline (time.monotonic()); events handled.
ReadSources = Callable[[float], Awaitable[int]]

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

HASTEN_BATCH = 1000  # pending keys per rule per hasten call
SETTLE_STEP = 0.05  # longest wait for held claims before the next round
OTHERS_STEP = (0.005, 0.2)  # polling bounds while only other nodes hold claims
LISTED = 5  # keys named per kind in a timeout's message


@dataclass(frozen=True, slots=True)
class Round:
    """What one drain round found (before its claims) and how many keys it claimed."""

    pending: int
    in_flight: int
    taken: int


class Drainer:
    """Drains one coalescer's namespace into one runner."""

    def __init__(self, ctx: NodeContext, *, runner: Runner,
                 flush: Callable[[], Awaitable[None]], redis: Any,
                 read_sources: ReadSources | None = None) -> None:
        self._config = ctx.config
        self._read_sources = read_sources
        self._keyspace = ctx.keyspace
        self._scripts = ctx.scripts
        self._runner = runner
        self._node_id = ctx.node_id
        self._flush = flush
        self._redis = redis
        self._names = [r.name for r in ctx.rules]
        self._item_rules = item_rules(ctx.rules)

    async def run(self, timeout: float) -> list[Claim]:
        """The claims this process ran, in the order they started; TimeoutError naming
        the keys still pending or in flight once ``timeout`` seconds have passed."""
        claims: list[Claim] = []
        self._runner.recorders.append(claims)
        try:
            deadline = time.monotonic() + timeout
            if not await self._until_empty(claims, deadline):
                raise TimeoutError(await self._left(timeout))
        finally:
            self._runner.recorders.remove(claims)
        log.debug("drain: ran %d claims", len(claims))
        return claims

    async def _until_empty(self, claims: list[Claim], deadline: float) -> bool:
        wait = OTHERS_STEP[0]
        while time.monotonic() < deadline:
            seen, idle = len(claims), self._runner.holding == 0
            if self._read_sources is not None:
                await self._read_sources(deadline)
            await self._flush()
            found = await self._round()
            if idle and not (found.pending or found.in_flight or found.taken) \
                    and len(claims) == seen:
                return True
            left = max(0.0, deadline - time.monotonic())
            if self._runner.holding:
                await self._runner.settle(min(SETTLE_STEP, left))
                wait = OTHERS_STEP[0]
            elif not found.taken:  # only other nodes hold claims: look again soon
                await asyncio.sleep(min(wait, left))
                wait = min(OTHERS_STEP[1], wait * 2)
        return False

    async def _round(self) -> Round:
        pending = in_flight = taken = 0
        for shard in self._keyspace.all_shards():
            attempts = [r.retry.attempts for r in self._config.rules]
            await self._scripts.recover(shard, self._names, RECOVER_BATCH, attempts)
            counts = await self._scripts.hasten(shard, self._names, HASTEN_BATCH)
            pending += counts.pending
            in_flight += counts.in_flight
            if counts.pending:
                taken += await self._take(shard.shard)
        return Round(pending, in_flight, taken)

    async def _take(self, shard: int) -> int:
        async def call(limits: list[tuple[str, int]]) -> Taken:
            return Taken(*await self._scripts.take(
                self._keyspace.shard(shard), node_id=self._node_id,
                claim_lease_ms=round(self._config.claim_lease * 1000), limits=limits,
                item_rules=self._item_rules))
        _, _, taken = await claim_into_slots(self._runner, shard, self._config.rules,
                                             MAX_CLAIM, call, queue=False)
        return sum(taken)

    async def _left(self, timeout: float) -> str:
        pending: list[str] = []
        in_flight: list[str] = []
        for shard in self._keyspace.all_shards():
            for name in self._names:
                pending += await self._redis.zrange(shard.due(name), 0, LISTED - 1)
                in_flight += await self._redis.zrange(shard.inflight(name), 0, LISTED - 1)
        return (f"drain(): not done after {timeout:g}s: still pending: {_listed(pending)}; "
                f"still in flight: {_listed(in_flight)}")


def _listed(keys: Sequence[Any]) -> str:
    if not keys:
        return "none"
    shown = [k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys]
    more = "" if len(shown) <= LISTED else f" and {len(shown) - LISTED} more"
    return ", ".join(repr(k) for k in shown[:LISTED]) + more


@contextlib.asynccontextmanager
async def local_runner(ctx: NodeContext, *, invokers: dict[str, Invoke]
                       ) -> AsyncIterator[Runner]:
    """A runner for a coalescer that is not a worker, living as long as one drain.

    Its results loop and lease renewal run meanwhile; claims still running when it ends
    (a drain that timed out) are cancelled and left to their leases.
    """
    runner = Runner(ctx, invokers=invokers, on_slot_free=lambda: None)
    tasks = [asyncio.create_task(runner.results_loop(), name="drain results"),
             asyncio.create_task(runner.renew_loop(), name="drain renew")]
    try:
        yield runner
    finally:
        if runner.holding:
            await runner.drain(0.0)
        with contextlib.suppress(Exception):
            await runner.flush_results()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
