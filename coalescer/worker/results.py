"""The outcomes of finished claims on their way to Redis: each shard's box of acks and
failures, group-committed (one ack and one fail call per shard, after ``ACK_GATHER`` so
that the results of quick refreshes share a call); a commit that fails is merged back
and tried again, nothing is lost."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coalescer.common.retrying import keep_running
from coalescer.config.rules import Rule
from coalescer.store.script_types import AckItem, Failure, History
from coalescer.worker.claims import item_rules
from coalescer.worker.failure_log import FailureLog
from coalescer.worker.jobs import Job
from coalescer.worker.run_log import log, log_dead

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

# The results loop waits this long after its first result before committing, so the results
# of several quick refreshes share one call (at concurrency 16 and no-op handlers, a
# commit per batch of 16 cost as many round trips as the claims themselves).
ACK_GATHER = 0.002


@dataclass(slots=True)
class Results:
    """Finished claims of one shard whose results Redis does not hold yet."""

    acks: list[Job] = field(default_factory=list)
    fails: list[tuple[Job, Failure]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.acks or self.fails)

    def merge(self, other: Results) -> None:
        self.acks[:0] = other.acks
        self.fails[:0] = other.fails


class ResultsOutbox:
    """The results of this node's finished claims until Redis holds them."""

    def __init__(self, ctx: NodeContext, jobs: dict[str, Job], failures: FailureLog,
                 on_forgotten: Callable[[], None]) -> None:
        """``jobs``: the runner's held claims, each forgotten once its result is recorded
        (then ``on_forgotten``); ``failures``: the runner's lines per kind of failure."""
        self._ctx = ctx
        self._scripts = ctx.scripts
        self._keyspace = ctx.keyspace
        self._history = History(ctx.node_id, ctx.config.history)
        self._item_rules = item_rules(ctx.config.rules)
        self._jobs = jobs
        self._failures = failures
        self._on_forgotten = on_forgotten
        self._boxes: dict[int, Results] = defaultdict(Results)
        self._event = asyncio.Event()

    def ack(self, job: Job) -> None:
        """``job`` succeeded: its ack goes with the next commit."""
        self._boxes[job.shard].acks.append(job)
        self._event.set()

    def fail(self, job: Job, failure: Failure) -> None:
        """``job`` failed: its ``failure`` goes with the next commit."""
        self._boxes[job.shard].fails.append((job, failure))
        self._event.set()

    async def run(self) -> None:
        """Group-commit acks and failures; survives Redis errors and retries them."""
        await keep_running("results: recording refresh outcomes", self._commit_next, logger=log,
                           on_error=lambda _: self._ctx.metrics.redis_errors.labels(
                               "results").inc())

    async def _commit_next(self) -> None:
        """Wait for results, then commit them; on an error they wait for the next try."""
        await self._event.wait()
        await asyncio.sleep(ACK_GATHER)  # let more results join this commit
        self._event.clear()
        boxes, self._boxes = self._boxes, defaultdict(Results)
        try:
            await asyncio.gather(*(self._commit(s, b) for s, b in boxes.items() if b))
        except Exception:
            for shard, box in boxes.items():
                self._boxes[shard].merge(box)
            self._event.set()
            raise

    async def _commit(self, shard: int, box: Results) -> None:
        keys = self._keyspace.shard(shard)
        stale: list[str] = []
        if box.acks:
            # per rule, and per call of a batch handler (its successes: one history entry)
            acks: dict[tuple[str, int, int], list[AckItem]] = defaultdict(list)
            for job in box.acks:
                claim = job.claim
                acks[job.rule.name, job.call, job.call_size].append(
                    (claim.key, claim.token, job.start_ms, job.duration_ms))
            answer = await self._scripts.ack_counted(
                keys, [(rule, items, size) for (rule, _, size), items in acks.items()],
                self._history, self._item_rules)
            stale += answer.stale
            for (rule_name, _, _), rearmed in zip(acks, answer.rearmed, strict=False):
                self._ctx.metrics.rule(rule_name).reruns += rearmed
            self._forget(box.acks)
            box.acks = []
        if box.fails:
            fails: dict[Rule, list[Failure]] = defaultdict(list)
            for job, failure in box.fails:
                fails[job.rule].append(failure)
            groups = [(rule.name, rule.retry.attempts, f) for rule, f in fails.items()]
            _, dead, failed_stale = await self._scripts.fail(keys, groups, self._history)
            stale += failed_stale
            log_dead(self._ctx, self._failures,
                     {job.claim.key: (job, f) for job, f in box.fails}, dead)
            self._forget([job for job, _ in box.fails])
        for key in stale:
            log.warning("claim of %s was taken over before its result was recorded", key)

    def _forget(self, jobs: list[Job]) -> None:
        for job in jobs:
            if self._jobs.get(job.claim.key) is job:
                del self._jobs[job.claim.key]
        self._on_forgotten()

    async def flush(self) -> None:
        """Record every finished claim's result now (used at shutdown)."""
        boxes, self._boxes = self._boxes, defaultdict(Results)
        await asyncio.gather(*(self._commit(s, b) for s, b in boxes.items() if b))
