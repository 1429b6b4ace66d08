"""Running a claim: its handler called (inside its refresh span with tracing on), or
one call of a batch handler for several claims; what a run that was cancelled, timed
out or never started becomes; how long it took. What happens then (its result
recorded, its slot freed, or the claim dropped) is the runner's."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Awaitable, Collection
from typing import TYPE_CHECKING

from coalescer.claim import Claim
from coalescer.config.rules import Rule
from coalescer.tracing import refresh_tracer
from coalescer.worker.batches import BatchAnswerError, failed_keys
from coalescer.worker.invoke import Invoke, NotStartedError, RunCancelled
from coalescer.worker.jobs import Batch, Job
from coalescer.worker.run_log import log

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext


def _failed_in(answer: object, claims: list[Claim]) -> Collection[str]:
    """The keys a batch handler's ``answer`` says failed (all of them when it does not
    read: they are all failed then)."""
    try:
        return failed_keys(answer, claims).keys()
    except BatchAnswerError:
        return [c.key for c in claims]


def _ends(exc: asyncio.CancelledError) -> asyncio.Future[object] | None:
    """The future of a handler that goes on past its cancelled run (None: it ended)."""
    ends = exc.ends if isinstance(exc, RunCancelled) else None
    return ends if ends is not None and not ends.done() else None


def _cut_short(rule: Rule, exc: asyncio.CancelledError, what: str = "handler") -> Exception:
    """The error of a run its timeout cancelled: it timed out, or never started."""
    if isinstance(exc, RunCancelled) and not exc.started:
        return NotStartedError(f"never started: {exc.why} within the timeout of "
                               f"{rule.timeout:g}s")
    return TimeoutError(f"{what} ran past its timeout of {rule.timeout:g}s")


class ClaimRuns(ABC):
    """The runs of claims' handlers; the runner decides what follows each."""

    def __init__(self, ctx: NodeContext, invokers: dict[str, Invoke]) -> None:
        self._metrics = ctx.metrics
        self._invokers = invokers
        self._calls: dict[str, int] = defaultdict(int)  # batch handler calls running, per rule
        self._tracer = refresh_tracer(ctx.scripts, ctx.keyspace)  # None: tracing off

    @abstractmethod
    def _finish(self, job: Job, exc: BaseException | None) -> None:
        """``job``'s run ended, well (``exc`` None) or not: record it, free its slot."""

    @abstractmethod
    def _drop(self, job: Job) -> None:
        """``job`` was cancelled: left to its lease."""

    @abstractmethod
    def _slots_freed(self, rule_name: str) -> None:
        """A slot of rule ``rule_name`` was freed."""

    async def _run(self, job: Job, invoke: Invoke) -> None:
        rule, claim = job.rule, job.claim
        if claim.attempt > rule.retry.attempts:
            self._finish(job, TimeoutError("claim lease expired on every attempt"))
            return
        started = time.monotonic()
        try:
            await self._invoke(job, invoke)
        except asyncio.CancelledError as exc:
            job.ends = _ends(exc)
            if not job.timed_out:
                self._drop(job)
                raise
            error: Exception | None = _cut_short(rule, exc)
        except Exception as exc:  # a handler's failure is data, not a crash
            error = exc
        else:
            error = None
        took = time.monotonic() - started
        job.took_ms = took * 1000
        job.duration_ms = round(job.took_ms)
        self._metrics.rule(rule.name).duration.observe(took)
        self._finish(job, error)

    def _invoke(self, job: Job, invoke: Invoke) -> Awaitable[object]:
        """The handler's call for ``job``, inside its refresh span with tracing on."""
        if self._tracer is None:
            return invoke(job.claim)
        return self._tracer.run_one(job.shard, job.rule_name, job.claim, job.touches,
                                    lambda: invoke(job.claim))

    async def _run_batch(self, rule: Rule, batch: Batch, jobs: list[Job]) -> None:
        """One call of a batch handler; each key's outcome goes to its results box."""
        spent = [j for j in jobs if j.claim.attempt > rule.retry.attempts]
        for job in spent:
            self._finish(job, TimeoutError("claim lease expired on every attempt"))
        jobs = [j for j in jobs if j.claim.attempt <= rule.retry.attempts]
        started, ends = time.monotonic(), None
        try:
            errors = await self._call_batch(rule, jobs)
        except asyncio.CancelledError as exc:
            ends = _ends(exc)
            for job in jobs:
                job.ends = ends
            if not any(job.timed_out for job in jobs):
                self._end_call(rule, ends)
                for job in jobs:
                    if job.batch is batch:
                        self._drop(job)
                raise
            errors = dict.fromkeys((job.claim.key for job in jobs),
                                   _cut_short(rule, exc, "batch handler"))
        took = time.monotonic() - started
        self._metrics.rule(rule.name).duration.observe(took)
        self._end_call(rule, ends)
        for job in jobs:
            job.took_ms = took * 1000
            job.duration_ms = round(job.took_ms)
            self._finish(job, errors.get(job.claim.key))

    def _end_call(self, rule: Rule, ends: asyncio.Future[object] | None) -> None:
        """A batch handler call ended; one whose handler goes on counts until ``ends``."""
        if ends is None:
            self._calls[rule.name] -= 1
            return

        def ended(_: object) -> None:
            self._calls[rule.name] -= 1
            self._slots_freed(rule.name)
        ends.add_done_callback(ended)

    async def _call_batch(self, rule: Rule, jobs: list[Job]) -> dict[str, BaseException]:
        """The failed keys of one batch handler call, each with its error."""
        if not jobs:
            return {}
        claims = [job.claim for job in jobs]
        try:
            answer = await self._invoke_batch(rule, jobs, claims)
            return dict(failed_keys(answer, claims))
        except BatchAnswerError as exc:
            log.error("rule %s: %s; failing all %d keys of the batch (they are retried)",
                      rule.name, exc, len(claims))
            return dict.fromkeys((c.key for c in claims), exc)
        except Exception as exc:  # a handler's failure is data, not a crash
            return dict.fromkeys((c.key for c in claims), exc)

    def _invoke_batch(self, rule: Rule, jobs: list[Job], claims: list[Claim]) -> Awaitable[object]:
        """A batch handler's call for ``jobs``, inside its span with tracing on."""
        invoke = self._invokers[rule.name]
        if self._tracer is None:
            return invoke(claims)
        return self._tracer.run_batch(rule.name, [(j.shard, j.claim, j.touches) for j in jobs],
                                      lambda: invoke(claims),
                                      lambda answer: _failed_in(answer, claims))
