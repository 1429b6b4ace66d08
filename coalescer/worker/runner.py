"""Runs claimed refreshes: per-rule concurrency, timeouts, retries, leases.

Each claim runs as one task; the claims of one rule that start together share
one timeout timer. A node holds up to twice a rule's ``concurrency`` claims (at
most ``MAX_QUEUED`` more): ``concurrency`` of them run, the others wait in
process for a slot and start the moment one frees, while the poller's next claim
call is already on its way. Claim calls then overlap with the refreshes instead
of alternating with them; at most ``concurrency`` refreshes of a rule ever run at
once on a node. A claim's outcome goes to its shard's results box, which is
group-committed to Redis (one ack and one fail call per shard). While a claim
is held (running, or finished but not yet acked) its lease is renewed every
quarter of ``claim_lease`` (``worker.claim_leases``); a claim that Redis says this
node lost, or that could not be renewed in time, is cancelled.

A batch rule (``batch: {max, wait}``) runs its claims as handler calls of up to
``max`` claims each; ``concurrency`` then counts calls. Claimed keys wait in
process until ``max`` of them are there or the oldest has waited ``wait``; each
key keeps its own outcome (the handler's answer says which failed, see
``worker.batches``), and the call's timeout and cancellation apply to all of them.

A handler that goes on past its run (a plain function's thread, which nothing can
stop, or a child process being killed: see ``worker.invoke``) keeps the run's slot
until it has ended: its timeout or loss is recorded at once (the key is retried per its
backoff, here or elsewhere), but the rule runs one refresh fewer meanwhile, and this
node starts no other run of that key: a new claim of it waits in process, and fails as
"never started" if the old run has not ended within the rule's timeout. At shutdown,
``drain`` waits for them within the grace too, then names the ones it abandons.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coalescer.claim import Claim, granted
from coalescer.common.plural import plural
from coalescer.common.printable import printable, unsafe_exception
from coalescer.common.retrying import keep_running
from coalescer.config.rules import Rule
from coalescer.store.scripts import History
from coalescer.tracing import refresh_tracer
from coalescer.worker.batches import BatchAnswerError, failed_keys
from coalescer.worker.claim_leases import ClaimLeases
from coalescer.worker.claims import AckItem, ClaimedKey, Failure, item_rules
from coalescer.worker.coalescing import observe_start
from coalescer.worker.failure_log import FailureLog
from coalescer.worker.invoke import Invoke, NotStartedError, RunCancelled

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)


MAX_ERROR_TEXT = 200
# The results loop waits this long after its first result before committing, so the results
# of several quick refreshes share one call (at concurrency 16 and no-op handlers, a
# commit per batch of 16 cost as many round trips as the claims themselves).
ACK_GATHER = 0.002
MAX_QUEUED = 1000  # claims of one rule held beyond its running ones, at most
# After the grace, cancelled runs get this long to end (a child process is stopped
# with SIGTERM, then SIGKILL) before the drain names what it abandons.
AFTER_GRACE = 1.0
ABANDONED_SHOWN = 20  # keys named in the line of the runs abandoned at shutdown


@dataclass(slots=True)
class Job:
    """One held claim on this node."""

    shard: int
    rule: Rule
    claim: Claim
    renewed: float  # when the lease last began (monotonic clock)
    held_since: float = 0.0  # when it was claimed (monotonic clock)
    clock_offset_ms: float = 0.0  # server clock minus ours, when it was claimed
    batch: Batch | None = None  # the claims started with it, sharing its timeout timer
    call: int = 0  # the batch handler call it ran in (numbered from 1; 0: run alone)
    call_size: int = 0  # how many keys that call had
    task: asyncio.Task[None] | None = None
    queued: bool = False  # claimed, waiting in process for a free slot
    timed_out: bool = False
    lost: bool = False
    start_ms: int = 0  # when the handler started, server clock (for the history)
    duration_ms: int = 0
    took_ms: float = 0.0  # duration_ms unrounded, for the log
    ends: asyncio.Future[object] | None = None  # its handler goes on past the run until done
    waiting: asyncio.TimerHandle | None = None  # queued behind an older run of its key
    touches: int = 1  # the burst's touches, as the claim counted them

    @property
    def key(self) -> str:
        return self.claim.key

    @property
    def token(self) -> int:
        return self.claim.token

    @property
    def rule_name(self) -> str:
        return self.rule.name


@dataclass(slots=True)
class Batch:
    """Claims of one rule started together: one timer cancels those still running at
    the rule's timeout, and is cancelled once every one of them has finished."""

    jobs: list[Job]
    left: int
    timer: asyncio.TimerHandle | None = None

    def time_out(self) -> None:
        for job in self.jobs:
            if job.task is not None and not job.task.done():
                job.timed_out = True
                job.task.cancel()

    def finished(self) -> None:
        """One of the claims finished (or was dropped)."""
        self.left -= 1
        if self.left <= 0:
            if self.timer is not None:
                self.timer.cancel()
            self.jobs = []


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


def _failed_in(answer: object, claims: list[Claim]) -> Collection[str]:
    """The keys a batch handler's ``answer`` says failed (all of them when it does not
    read: they are all failed then)."""
    try:
        return failed_keys(answer, claims).keys()
    except BatchAnswerError:
        return [c.key for c in claims]


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:MAX_ERROR_TEXT]


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


class Runner:
    """Holds this node's claims and runs their handlers."""

    def __init__(self, ctx: NodeContext, *, invokers: dict[str, Invoke],
                 on_slot_free: Callable[[], None],
                 on_finish: Callable[[str, bool], None] | None = None) -> None:
        """``on_slot_free`` is called soon after slots are freed (once for several);
        ``on_finish(key, failed)`` as each run finishes (not when its claim was lost)."""
        self._scripts = ctx.scripts
        self._hints = ctx.hints
        self._history = History(ctx.node_id, ctx.config.history)
        self._item_rules = item_rules(ctx.config.rules)
        self._keyspace = ctx.keyspace
        self._metrics = ctx.metrics
        self._invokers = invokers
        self._claim_lease = ctx.claim_lease
        self._on_slot_free = on_slot_free
        self._on_finish = on_finish
        self._jobs: dict[str, Job] = {}
        self._active: dict[str, int] = defaultdict(int)  # held + reserved, per rule
        self._running: dict[str, int] = defaultdict(int)  # refreshes running, per rule
        self._queued: dict[str, deque[Job]] = defaultdict(deque)  # claimed, waiting for a slot
        self._freed: dict[str, int] = defaultdict(int)  # slots ever freed, per rule
        # Keys whose last run on this node has not ended yet (cancelled, or past its
        # timeout): no other run of the key starts here meanwhile.
        self._ending: dict[str, Job] = {}
        self._held: dict[str, int] = defaultdict(int)  # slots they hold, per rule
        self._calls: dict[str, int] = defaultdict(int)  # batch handler calls running, per rule
        self._batch_timers: dict[str, asyncio.TimerHandle] = {}  # a batch waiting to fill
        self._last_call = 0  # batch handler calls numbered on this node
        self._slot_free_due = False
        self._results: dict[int, Results] = defaultdict(Results)
        self._results_event = asyncio.Event()
        self._idle_event = asyncio.Event()
        self._idle_event.set()
        self._stop_now = asyncio.Event()  # a drain ends at once: stop_now()
        self._random = random.Random()
        self.recorders: list[list[Claim]] = []  # each gets every claim started (drain)
        self._failures = FailureLog()  # one line per kind of failure per period
        self._leases = ClaimLeases(ctx, self._jobs, self._lose)
        self._tracer = refresh_tracer(ctx.scripts, ctx.keyspace)  # None: tracing off

    # -- claims in -----------------------------------------------------------------

    @staticmethod
    def run_capacity(rule: Rule) -> int:
        """How many claims of ``rule`` run at once: ``concurrency``, times ``max`` for a
        batch rule."""
        size = rule.batch.max if rule.batch is not None else 1
        return int(rule.concurrency) * size

    @classmethod
    def capacity(cls, rule: Rule) -> int:
        """How many claims of ``rule`` a node holds at most: running ones and queued ones
        (a batch rule queues one full batch: each held claim's lease is renewed)."""
        run = cls.run_capacity(rule)
        return run + (min(run, MAX_QUEUED) if rule.batch is None else rule.batch.max)

    def free_slots(self, rule: Rule) -> int:
        return max(0, self.capacity(rule) - self._active[rule.name])

    def reserve(self, rule: Rule, most: int, *, queue: bool = True) -> int:
        """Take up to ``most`` free slots of ``rule`` for a claim call; returns how many.

        Each claimed key then ``start``s in one of them; ``unreserve`` gives back the
        rest. Reserving before the claim call keeps two shards' pollers, claiming at
        the same time, from both filling the same free slots. ``queue=False`` takes
        only slots a claim can run in at once (none to wait in process).
        """
        free = self.free_slots(rule) if queue else max(
            0, self.run_capacity(rule) - self._active[rule.name])
        n = min(most, free)
        self._active[rule.name] += n
        return n

    def unreserve(self, rule: Rule, n: int) -> None:
        """Give back ``n`` reserved slots that no claimed key took."""
        if n > 0:
            self._active[rule.name] -= n
            self._slots_freed(rule.name)

    def freed(self, rule: Rule) -> int:
        """How many slots of ``rule`` were ever freed: compare two readings to see if any was."""
        return self._freed[rule.name]

    def start_all(self, shard: int, rules: Sequence[Rule], claims: Sequence[ClaimedKey],
                  clock_offset_ms: float, *, taken: list[int], sent: float) -> None:
        """Start the handlers of one claim call's fresh claims, each in a slot ``reserve``
        took; ``taken[i]`` counts the claims of ``rules[i]`` started. ``sent``: when the
        claim call was sent (monotonic clock), which their leases began after."""
        groups: dict[int, list[ClaimedKey]] = defaultdict(list)
        for claimed in claims:
            groups[claimed.rule_index].append(claimed)
        for index, group in groups.items():
            self.start(shard, rules[index], group, clock_offset_ms, sent)
            taken[index] += len(group)

    def start(self, shard: int, rule: Rule, claims: Sequence[ClaimedKey],
              clock_offset_ms: float, sent: float) -> None:
        """Start the handlers of fresh claims of ``rule``, each in a slot ``reserve`` took;
        those past the rule's ``concurrency`` wait in process for a running one to end."""
        if not claims:
            return
        name, jobs = rule.name, self._jobs
        matcher = rule.params if rule.pattern.names else None
        held_since = time.monotonic()
        self._leases.claimed(sent)
        fresh = []
        for c in claims:
            claim = granted(c, name, (matcher(c.key) or {}) if matcher else {})
            if c.overflowed:
                self._metrics.item_overflows.labels(name).inc()
            job = Job(shard, rule, claim, sent, held_since, clock_offset_ms, touches=c.touches)
            self._supersede(jobs.get(claim.key))
            jobs[claim.key] = job
            fresh.append(job)
            for recorder in self.recorders:
                recorder.append(claim)
        self._idle_event.clear()
        if rule.batch is not None:
            for job in fresh:
                job.queued = True
            self._queued[name].extend(fresh)
            self._fill(rule)
            return
        self._enqueue(rule, fresh)

    def _enqueue(self, rule: Rule, fresh: list[Job]) -> None:
        """Queue fresh claims of ``rule`` (not a batch rule) and start those it has a free
        slot for."""
        name = rule.name
        for job in fresh:
            job.queued = True
        self._queued[name].extend(fresh)
        self._launch(rule, self._take(rule, int(rule.concurrency) - self._running[name]))
        if self._held[name]:  # runs past their end hold slots: the others may never free
            for job in fresh:
                if job.queued:
                    self._wait_at_most(job)

    def _take(self, rule: Rule, most: int) -> list[Job]:
        """Up to ``most`` queued claims of ``rule`` that can start now, in order; one whose
        key's last run here has not ended stays queued (see ``_wait_at_most``)."""
        queue, jobs = self._queued[rule.name], list[Job]()
        kept: list[Job] = []
        while queue and len(jobs) < most:
            job = queue.popleft()
            if self._ending and job.claim.key in self._ending:
                self._wait_at_most(job)
                kept.append(job)
                continue
            job.queued = False
            jobs.append(job)
        queue.extendleft(reversed(kept))
        return jobs

    def _wait_at_most(self, job: Job) -> None:
        """``job`` waits behind a run that went on past its end (of its key, or holding a
        slot of its rule): it fails as never started if it has not started within its
        rule's timeout (a claim waiting only behind runs that end in time never does)."""
        if job.waiting is None:
            log.debug("claim of %s waits behind runs that went on past their end",
                      job.claim.key)
            job.waiting = asyncio.get_running_loop().call_later(
                job.rule.timeout, self._never_started, job)

    def _never_started(self, job: Job) -> None:
        job.waiting = None
        if not job.queued or self._jobs.get(job.claim.key) is not job:
            return
        if job.claim.key in self._ending:
            why = "its previous run on this node had not ended"
        else:
            why = "no free slot: runs of its rule went on past their timeout"
        job.start_ms = round(time.time() * 1000 + job.clock_offset_ms)
        self._finish(job, NotStartedError(
            f"never started: {why} within the timeout of {job.rule.timeout:g}s"))

    def _launch(self, rule: Rule, jobs: list[Job]) -> None:
        """Run ``jobs`` (of ``rule``) now, as one batch with one timeout timer."""
        if not jobs:
            return
        loop = asyncio.get_running_loop()
        create_task, invoke = loop.create_task, self._invokers[rule.name]
        metrics = self._metrics.rule(rule.name)
        batch = Batch(jobs, len(jobs))
        now = time.time() * 1000
        self._running[rule.name] += len(jobs)
        for job in jobs:
            job.batch = batch
            server_now = now + job.clock_offset_ms
            job.start_ms = round(server_now)
            observe_start(metrics, rule, job.claim, job.touches, server_now)
            job.task = create_task(self._run(job, invoke), name=f"refresh {job.claim.key}")
        # One timer a batch (far cheaper than a timer, or a timeout block, per refresh).
        batch.timer = loop.call_later(rule.timeout, batch.time_out)

    def _start_queued(self) -> None:
        """Start queued claims in the slots freed since the last turn of the event loop."""
        for name, queue in self._queued.items():
            if not queue:
                continue
            rule = queue[0].rule
            if rule.batch is not None:
                self._fill(rule)
                continue
            self._launch(rule, self._take(rule, int(rule.concurrency) - self._running[name]))

    # -- batch rules ---------------------------------------------------------------------

    def _fill(self, rule: Rule) -> None:
        """Start the batches of ``rule`` that are ready, while calls are free: a full one,
        or the keys there once the oldest has waited ``batch.wait`` (not waited while a
        drain records what runs: a drain skips every wait)."""
        assert rule.batch is not None
        size, wait = rule.batch.max, 0.0 if self.recorders else rule.batch.wait
        queue, name = self._queued[rule.name], rule.name
        while queue and self._calls[name] < int(rule.concurrency):
            waited = time.monotonic() - queue[0].held_since
            if len(queue) < size and waited < wait:
                self._fill_later(rule, wait - waited)
                return
            jobs = self._take(rule, size)
            if not jobs:
                return
            self._launch_batch(rule, jobs)
        if queue and self._held[name]:  # calls past their end hold slots: may never free
            for job in queue:
                self._wait_at_most(job)

    def _fill_later(self, rule: Rule, delay: float) -> None:
        if rule.name in self._batch_timers:
            return

        def again() -> None:
            del self._batch_timers[rule.name]
            self._fill(rule)
        self._batch_timers[rule.name] = asyncio.get_running_loop().call_later(delay, again)

    def _launch_batch(self, rule: Rule, jobs: list[Job]) -> None:
        """Run ``jobs`` as one call of ``rule``'s batch handler, with one timeout timer."""
        loop = asyncio.get_running_loop()
        metrics = self._metrics.rule(rule.name)
        metrics.batch_size.observe(len(jobs))
        batch = Batch(jobs, len(jobs))
        self._calls[rule.name] += 1
        self._last_call += 1
        now = time.time() * 1000
        task = loop.create_task(self._run_batch(rule, batch, list(jobs)),
                                name=f"batch of {len(jobs)} {rule.name}")
        for job in jobs:
            job.batch, job.call, job.call_size = batch, self._last_call, len(jobs)
            server_now = now + job.clock_offset_ms
            job.start_ms = round(server_now)
            observe_start(metrics, rule, job.claim, job.touches, server_now)
            job.task = task
        batch.timer = loop.call_later(rule.timeout, batch.time_out)

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

    def _invoke_batch(self, rule: Rule, jobs: list[Job], claims: list[Claim]) -> Awaitable[object]:
        """A batch handler's call for ``jobs``, inside its span with tracing on."""
        invoke = self._invokers[rule.name]
        if self._tracer is None:
            return invoke(claims)
        return self._tracer.run_batch(rule.name, [(j.shard, j.claim, j.touches) for j in jobs],
                                      lambda: invoke(claims),
                                      lambda answer: _failed_in(answer, claims))

    def _finish(self, job: Job, exc: BaseException | None) -> None:
        rule, claim = job.rule, job.claim
        box = self._results[job.shard]
        if exc is None:
            box.acks.append(job)
            self._metrics.rule(rule.name).outcomes["success"] += 1
            log.debug("refreshed %s in %.1f ms (attempt %d, token %d)", claim.key,
                      job.took_ms, claim.attempt, claim.token)
        else:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "failure"
            self._metrics.rule(rule.name).outcomes[outcome] += 1
            delay_ms = round(rule.retry.delay(claim.attempt, self._random) * 1000)
            self._log_failure(job, exc, delay_ms)
            box.fails.append((job, Failure(claim.key, claim.token, delay_ms, _error_text(exc),
                                           outcome, job.start_ms, job.duration_ms)))
        self._release_slot(job)
        if not self._results_event.is_set():
            self._results_event.set()
        if self._on_finish is not None:
            self._on_finish(claim.key, exc is not None)

    def _log_failure(self, job: Job, exc: BaseException, delay_ms: int) -> None:
        """One line per kind of failure (rule and error type) per period, with its
        traceback; the others of the period are counted (see failure_log.py)."""
        left_out = self._failures.admit(("failed", job.rule.name, type(exc).__name__))
        if left_out is None:
            return
        claim, attempts = job.claim, job.rule.retry.attempts
        then = f"; retry in {delay_ms / 1000:g}s" if claim.attempt < attempts else ""
        then += self._failures.note(left_out)
        trace = exc.__traceback__ is not None
        key, text = printable(claim.key), printable(_error_text(exc))
        if trace and (key != claim.key or unsafe_exception(exc)):
            # a forged key, or a message anywhere in the traceback: it goes escaped, as
            # part of the line
            then += "; " + printable("".join(traceback.format_exception(exc)))
            trace = False
        log.warning("refresh of %s failed (attempt %d of %d): %s%s", key,
                    min(claim.attempt, attempts), attempts, text, then,
                    exc_info=exc if trace else None)

    def _log_dead(self, jobs: dict[str, tuple[Job, Failure]], dead: list[str]) -> None:
        for key in dead:
            job, failure = jobs[key]
            attempts = min(job.claim.attempt, job.rule.retry.attempts)
            self._metrics.rule(job.rule.name).dead_lettered += 1
            left_out = self._failures.admit(("dead", job.rule.name,
                                             failure.error.split(":", 1)[0]))
            if left_out is None:
                continue
            log.error("%s dead-lettered after %s: %s; re-queue with %s%s%s",
                      printable(key), plural(attempts, "attempt"), printable(failure.error),
                      printable(self._hints.command("dead retry", key)), self._hints.note,
                      self._failures.note(left_out))

    def _drop(self, job: Job) -> None:
        """A cancelled claim: left to its lease (another node, or we, re-run it)."""
        self._release_slot(job)
        if self._jobs.get(job.claim.key) is job:  # not a newer claim of the same key
            del self._jobs[job.claim.key]
        self._check_idle()

    def _supersede(self, old: Job | None) -> None:
        """A newer claim of ``old``'s key came (its lease expired and the key was claimed
        again, here): the old claim is not ours any more, so it is neither renewed nor
        run on (its result, if it has one, is recorded as stale)."""
        if old is None:
            return
        old.lost = True
        if old.queued:
            self._drop(old)
        elif old.task is not None and not old.task.done():
            self._ending.setdefault(old.claim.key, old)  # the newer one waits for its end
            old.task.cancel()

    def _release_slot(self, job: Job) -> None:
        if job.batch is not None:
            job.batch.finished()
            job.batch = None
        if job.queued:  # never started
            job.queued = False
            if job.waiting is not None:
                job.waiting.cancel()
                job.waiting = None
            self._queued[job.rule.name].remove(job)
        elif job.ends is not None:  # its handler goes on: the slot is held until it ends
            self._hold_slot(job, job.ends)
            return
        elif job.rule.batch is None:  # a batch rule counts its calls (_calls)
            self._running[job.rule.name] -= 1
        if self._ending.get(job.claim.key) is job:
            del self._ending[job.claim.key]
        self._active[job.rule.name] -= 1
        self._slots_freed(job.rule.name)

    def _hold_slot(self, job: Job, ends: asyncio.Future[object]) -> None:
        name = job.rule.name
        self._ending[job.claim.key] = job
        self._held[name] += 1
        for waiting in self._queued[name]:
            self._wait_at_most(waiting)

        def ended(_: object) -> None:
            job.ends = None
            self._held[name] -= 1
            self._release_slot(job)
            if not self._held[name]:
                self._stop_waiting(name)
        ends.add_done_callback(ended)

    def _stop_waiting(self, name: str) -> None:
        """No run of rule ``name`` holds a slot past its end any more: its queued claims
        wait for runs that end in time, never failed as never started."""
        for job in self._queued[name]:
            if job.waiting is not None and job.claim.key not in self._ending:
                job.waiting.cancel()
                job.waiting = None

    def _slots_freed(self, rule_name: str) -> None:
        # Counted at once (a poller compares readings taken around its claim call);
        # announced once for every slot freed in this turn of the event loop.
        self._freed[rule_name] += 1
        if not self._slot_free_due:
            self._slot_free_due = True
            asyncio.get_running_loop().call_soon(self._announce_slot_free)

    def _announce_slot_free(self) -> None:
        self._slot_free_due = False
        self._start_queued()
        self._on_slot_free()

    def _check_idle(self) -> None:
        if not self._jobs:
            self._idle_event.set()

    # -- outcomes out ----------------------------------------------------------------

    async def results_loop(self) -> None:
        """Group-commit acks and failures; survives Redis errors and retries them."""
        await keep_running("results: recording refresh outcomes", self._commit_next, logger=log,
                           on_error=lambda _: self._metrics.redis_errors.labels(
                               "results").inc())

    async def _commit_next(self) -> None:
        """Wait for results, then commit them; on an error they wait for the next try."""
        await self._results_event.wait()
        await asyncio.sleep(ACK_GATHER)  # let more results join this commit
        self._results_event.clear()
        boxes, self._results = self._results, defaultdict(Results)
        try:
            await asyncio.gather(*(self._commit(s, b) for s, b in boxes.items() if b))
        except Exception:
            for shard, box in boxes.items():
                self._results[shard].merge(box)
            self._results_event.set()
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
                self._metrics.rule(rule_name).reruns += rearmed
            self._forget(box.acks)
            box.acks = []
        if box.fails:
            fails: dict[Rule, list[Failure]] = defaultdict(list)
            for job, failure in box.fails:
                fails[job.rule].append(failure)
            groups = [(rule.name, rule.retry.attempts, f) for rule, f in fails.items()]
            _, dead, failed_stale = await self._scripts.fail(keys, groups, self._history)
            stale += failed_stale
            self._log_dead({job.claim.key: (job, f) for job, f in box.fails}, dead)
            self._forget([job for job, _ in box.fails])
        for key in stale:
            log.warning("claim of %s was taken over before its result was recorded", key)

    def _forget(self, jobs: list[Job]) -> None:
        for job in jobs:
            if self._jobs.get(job.claim.key) is job:
                del self._jobs[job.claim.key]
        self._check_idle()

    async def flush_results(self) -> None:
        """Record every finished claim's result now (used at shutdown)."""
        boxes, self._results = self._results, defaultdict(Results)
        await asyncio.gather(*(self._commit(s, b) for s, b in boxes.items() if b))

    # -- leases ------------------------------------------------------------------------

    async def renew_loop(self) -> None:
        """Renew what this node holds on a fixed beat, stop what could not be renewed in
        time (``worker.claim_leases``), until cancelled."""
        await self._leases.run()

    async def renew_once(self) -> None:
        """Renew every claim held now (one call per shard)."""
        await self._leases.renew_once()

    def _lose(self, key: str, token: int | None = None) -> None:
        """The claim of ``key`` (with ``token``, if given: a renewal sent before a newer
        claim of the key came answers for the older one) is no longer held."""
        job = self._jobs.get(key)
        if job is None or (token is not None and job.claim.token != token):
            return
        job.lost = True
        if job.queued:
            log.warning("lost the claim of %s (lease expired, token %d) before it started",
                        key, job.claim.token)
            self._drop(job)
        elif job.task is not None and not job.task.done():
            log.warning("lost the claim of %s (lease expired, token %d): stopping its refresh",
                        key, job.claim.token)
            job.task.cancel()
        else:
            # Finished: usually its ack reached Redis just before this renewal did; a
            # real takeover is reported when its result is recorded as stale.
            log.debug("claim of %s (token %d) no longer held after it finished",
                      key, job.claim.token)
            self._jobs.pop(key, None)
            self._check_idle()

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` until no claim is held (every result recorded)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle_event.wait(), timeout)

    @property
    def holding(self) -> int:
        """How many claims this node holds (running, or finished but not yet recorded)."""
        return len(self._jobs)

    def running_keys(self) -> list[str]:
        """The keys whose refreshes run here now, or wait for a slot of their rule."""
        return [key for key, job in self._jobs.items()
                if job.queued or (job.task is not None and not job.task.done())]

    # -- shutdown ----------------------------------------------------------------------

    def stop_now(self) -> None:
        """End the drain under way (or the next) at once: what still runs is cancelled
        as at the end of the grace, and handlers that go on are not waited for."""
        self._stop_now.set()

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` for held claims to finish and for handlers that went on
        past their run to end, then cancel the rest (a child process is killed) and name
        the runs abandoned: a thread in a handler cannot be stopped, it ends with the
        process (its threads never keep the process from exiting). ``stop_now()`` ends
        the wait early."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        await self._unless_stopped(self._idle_event.wait(), grace)
        if not self._idle_event.is_set():
            await self._cancel_all(grace)
        ending = [j.ends for j in self._ending.values() if j.ends is not None]
        if ending and not self._stop_now.is_set():
            await self._unless_stopped(asyncio.wait(ending),
                                       max(end - loop.time(), AFTER_GRACE))
        self._log_abandoned()

    async def _unless_stopped(self, aw: Awaitable[object], timeout: float) -> None:
        """Wait up to ``timeout`` for ``aw``, or until ``stop_now()``."""
        waits = [asyncio.ensure_future(aw), asyncio.ensure_future(self._stop_now.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _cancel_all(self, grace: float) -> None:
        for job in [j for j in self._jobs.values() if j.queued]:
            self._drop(job)  # never started: re-run once its claim lease expires
        tasks = [j.task for j in self._jobs.values() if j.task and not j.task.done()]
        after = "at once" if self._stop_now.is_set() else f"after {grace:.1f}s"
        log.warning("shutdown: cancelling %s still running %s; "
                    "they re-run once their claim lease expires",
                    plural(len(tasks), "refresh", "refreshes"), after)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _log_abandoned(self) -> None:
        keys = [key for key, job in self._ending.items() if job.ends is not None]
        if not keys:
            return
        shown = ", ".join(printable(key) for key in keys[:ABANDONED_SHOWN])
        more = len(keys) - ABANDONED_SHOWN
        log.warning("shutdown: abandoning %s still running past the grace (a thread in a "
                    "handler ends with the process): %s%s", plural(len(keys), "handler"),
                    shown, f" and {more} more" if more > 0 else "")
