"""A shard poller's side of the rules' rates: how many due keys of a rule may start.

(An adopter, serving on a shard the rules its leader lacks, paces its rules the same
way: what is said here of a poller and its claim call holds for it and adopt calls.)

A rule with ``rate:`` shares one token bucket (``take_rate.lua``) among the pollers of
every shard, on every node; taking from it is a call of its own before the shard's claim
call. What a rate does and does not (the excess waits, starts not running refreshes,
unused tokens given back, bursts): docs/batches.md, "rate". Here:

* tokens are asked for only while the rule has keys due now, as the previous claim call
  reported (``ClaimBatch.held``), and never more than the keys due and the slots
  reserved that a claim *runs* in at once;
* a key that newly fell due was held by its first claim call (no tokens yet):
  ``retry_now`` then asks the poller to claim again at once, with tokens (as it does
  whenever keys are left due while the bucket may have starts and the rule had slots to
  run them: each such call claims or learns how long to wait, so it never spins); a rule
  with keys due and no slot to run one (``slot_bound``) waits for a freed slot;
* while the bucket is empty the poller sleeps until it holds the starts wanted
  (``wait``), capped as every sleep is; it never asks again before then.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from coalescer.common.metrics import Metrics
from coalescer.config.model import RateLimit
from coalescer.config.rules import Rule
from coalescer.store.keys import rate_bucket
from coalescer.store.script_types import AdoptBatch, ClaimBatch, RateGrant
from coalescer.store.scripts import Scripts

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

Limits = list[tuple[str, int]]


@dataclass(slots=True)
class _Rated:
    """One rated rule of the poller: its bucket, and what the last claim said of it."""

    rule: Rule
    rate: RateLimit
    bucket: str
    due: int = 0  # keys due now the last claim left (0: none, or not known yet)
    ready_at: float = 0.0  # time.monotonic() before which the bucket has no starts for us
    runnable: int = 0  # slots the last claim call had for it that a claim runs in at once
    granted: int = 0  # starts the last take granted for that call


class Slots(Protocol):
    """The handler slots of the node (the runner): how many claims of a rule it holds
    at most (running and waiting), and how many more it can take now."""

    def capacity(self, rule: Rule) -> int: ...

    def free_slots(self, rule: Rule) -> int: ...


class RateGate:
    """The rates of one shard poller's rules (indices as in ``rules``)."""

    def __init__(self, ctx: NodeContext, *, shard: int, rules: Sequence[Rule],
                 slots: Slots) -> None:
        self._scripts: Scripts = ctx.scripts
        self._slots = slots
        self._shard = shard
        self._metrics: Metrics = ctx.metrics
        namespace = ctx.keyspace.namespace
        self._rated = {i: _Rated(rule, rule.rate, rate_bucket(namespace, rule.name))
                       for i, rule in enumerate(rules) if rule.rate is not None}
        self.retry_now = False  # a rated rule's keys fell due: claim again, with tokens
        self.slot_bound: list[int] = []  # rated rules with keys due and no slot to run them
        self.wait: float | None = None  # seconds until a bucket has the starts wanted

    def __bool__(self) -> bool:
        return bool(self._rated)

    async def limit(self, limits: Limits) -> Limits:
        """``limits`` (the slots reserved per rule) with each rated rule's cut to the
        starts its bucket grants now."""
        now = time.monotonic()
        for i, r in self._rated.items():
            r.runnable, r.granted = self._runnable(r.rule, limits[i][1]), 0
        wants = {i: self._want(r, now) for i, r in self._rated.items()}
        asks = {i: n for i, n in wants.items() if n > 0}
        grants = await asyncio.gather(*(
            self._scripts.take_rate(self._rated[i].bucket, self._rated[i].rate, n)
            for i, n in asks.items()))
        out = list(limits)
        for i, r in self._rated.items():
            out[i] = (r.rule.name, 0)
        for (i, n), grant in zip(asks.items(), grants, strict=True):
            self._granted(i, n, grant, now)
            out[i] = (self._rated[i].rule.name, grant.granted)
        return out

    def _runnable(self, rule: Rule, reserved: int) -> int:
        """Of the ``reserved`` slots, how many a claim starts in at once."""
        held = self._slots.capacity(rule) - self._slots.free_slots(rule) - reserved
        return max(0, min(reserved, int(rule.concurrency) - held))

    @staticmethod
    def _want(r: _Rated, now: float) -> int:
        if r.due <= 0 or r.runnable <= 0 or now < r.ready_at:
            return 0
        return min(r.runnable, r.due)

    def _granted(self, i: int, wanted: int, grant: RateGrant, now: float) -> None:
        r = self._rated[i]
        r.granted = grant.granted
        r.ready_at = now + grant.wait_ms / 1000 if grant.granted < wanted else 0.0
        if grant.granted < wanted:
            self._metrics.rate_waits.labels(r.rule.name).inc()

    async def settle(self, batch: ClaimBatch | AdoptBatch) -> None:
        """After the claim call: give back unused starts, note what is still due, and
        decide ``retry_now`` and ``wait``."""
        taken = Counter(c.rule_index for c in batch.claims)
        unused = {i: r.granted - taken[i] for i, r in self._rated.items()
                  if r.granted > taken[i]}
        if unused:
            await asyncio.gather(*(
                self._scripts.take_rate(self._rated[i].bucket, self._rated[i].rate, 0, n)
                for i, n in unused.items()))
        now = time.monotonic()
        self.retry_now, self.slot_bound, waits = False, [], []
        for i, r in self._rated.items():
            r.due = batch.held.get(i, 0)
            if r.due and r.runnable == 0:
                self.slot_bound.append(i)  # waits for a slot to run in, then for starts
            elif r.due and r.ready_at > now:
                waits.append(r.ready_at - now)
            elif r.due:
                # Starts may be there (a key newly due was claimed without asking, or
                # more fell due than were asked for): claim again at once, asking.
                self.retry_now = True
            self._metrics.hold(r.rule.name, self._shard, r.due)
        self.wait = min(waits, default=None)

    def close(self) -> None:
        """This poller stopped leading its shard: it holds nothing back any more."""
        for r in self._rated.values():
            r.due = 0
            self._metrics.hold(r.rule.name, self._shard, 0)
