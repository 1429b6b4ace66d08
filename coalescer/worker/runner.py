"""Runs claimed refreshes: per-rule concurrency, timeouts, retries, leases.

Each claim runs as one task; the claims of one rule that start together share one
timeout timer. A node holds up to twice a rule's ``concurrency`` claims (at most
``MAX_QUEUED`` more), so claim calls overlap with the refreshes; its outcomes go to its
shard's results box, group-committed to Redis, and its lease is renewed while it is
held (``worker.claim_leases``): docs/concepts.md, "Runner". A batch rule runs its
claims as handler calls of up to ``max`` claims each (docs/batches.md; each key keeps
its own outcome: ``worker.batches``). A handler that goes on past its run (a plain
function's thread, or a child process being killed: ``worker.invoke``) keeps the run's
slot until it has ended, and this node starts no other run of that key meanwhile
(docs/rules.md, "What a handler that never returns costs"); at shutdown ``drain``
waits for them within the grace too, then names the ones it abandons.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from coalescer.claim import Claim, granted
from coalescer.common.plural import plural
from coalescer.config.rules import Rule
from coalescer.store.script_types import Failure
from coalescer.worker.claim_leases import ClaimLeases
from coalescer.worker.claim_runs import ClaimRuns
from coalescer.worker.claims import ClaimedKey
from coalescer.worker.coalescing import observe_start
from coalescer.worker.failure_log import FailureLog
from coalescer.worker.invoke import Invoke, NotStartedError
from coalescer.worker.jobs import Batch, Job
from coalescer.worker.results import ResultsOutbox
from coalescer.worker.run_log import error_text, log_abandoned, log_failure

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

MAX_QUEUED = 1000  # claims of one rule held beyond its running ones, at most
# After the grace, cancelled runs get this long to end (a child process is stopped
# with SIGTERM, then SIGKILL) before the drain names what it abandons.
AFTER_GRACE = 1.0


class Runner(ClaimRuns):
    """Holds this node's claims and runs their handlers."""

    def __init__(self, ctx: NodeContext, *, invokers: dict[str, Invoke],
                 on_slot_free: Callable[[], None],
                 on_finish: Callable[[str, bool], None] | None = None) -> None:
        """``on_slot_free`` is called soon after slots are freed (once for several);
        ``on_finish(key, failed)`` as each run finishes (not when its claim was lost)."""
        super().__init__(ctx, invokers)
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
        self._batch_timers: dict[str, asyncio.TimerHandle] = {}  # a batch waiting to fill
        self._last_call = 0  # batch handler calls numbered on this node
        self._slot_free_due = False
        self._idle_event = asyncio.Event()
        self._idle_event.set()
        self._stop_now = asyncio.Event()  # a drain ends at once: stop_now()
        self._random = random.Random()
        self.recorders: list[list[Claim]] = []  # each gets every claim started (drain)
        self._failures = FailureLog()  # one line per kind of failure per period
        self._outbox = ResultsOutbox(ctx, self._jobs, self._failures, self._check_idle)
        self._leases = ClaimLeases(ctx, self._jobs, self._lose)

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

    # -- after a run -------------------------------------------------------------------

    def _finish(self, job: Job, exc: BaseException | None) -> None:
        rule, claim = job.rule, job.claim
        if exc is None:
            self._outbox.ack(job)
            self._metrics.rule(rule.name).outcomes["success"] += 1
            log.debug("refreshed %s in %.1f ms (attempt %d, token %d)", claim.key,
                      job.took_ms, claim.attempt, claim.token)
        else:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "failure"
            self._metrics.rule(rule.name).outcomes[outcome] += 1
            delay_ms = round(rule.retry.delay(claim.attempt, self._random) * 1000)
            log_failure(self._failures, job, exc, delay_ms)
            self._outbox.fail(job, Failure(claim.key, claim.token, delay_ms, error_text(exc),
                                           outcome, job.start_ms, job.duration_ms))
        self._release_slot(job)
        if self._on_finish is not None:
            self._on_finish(claim.key, exc is not None)

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
        await self._outbox.run()

    async def flush_results(self) -> None:
        """Record every finished claim's result now (used at shutdown)."""
        await self._outbox.flush()

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
        log_abandoned(self._ending)

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
