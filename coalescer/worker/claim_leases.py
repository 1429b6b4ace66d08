"""Keeps the leases of the claims a node holds, and stops a run before its lease can lapse.

A claim's lease is its score in the shard's in-flight set; a taker (the shard's leader)
re-queues the claim only once it has seen that score unchanged for a full
``claim_lease`` by its own clock (``worker.lapsed``). On the holder's side:

* **Renewals on a fixed beat.** Every quarter lease one renewal goes out, one call per
  shard, all at once, sent at once (never queued behind other calls), whatever became of
  the previous one (at most ``IN_FLIGHT`` unanswered). Each has a deadline of three
  quarters of the lease, past which it is given up on (not cancelled: that would cost
  its connection, and a new one costs round trips); nothing waits on redis-py's socket
  timeout and retries. Claims granted by a slow claim call are renewed at once: the
  claim's round trip already took part of its lease. A round trip of up to a third of
  the lease therefore keeps every lease: the last renewal that got through was sent at
  most a quarter plus a third of a lease ago.
* **A watchdog on its own timer.** A claim whose last renewal that got through was
  *sent* (or whose claim call was sent) three quarters of a lease ago is stopped: its
  handler is cancelled (a process-isolated one killed), a claim still waiting for a
  slot never starts. It never waits on a reply that may never come, and it acts a
  quarter lease before any taker can: the server stamped the renewal after it was sent,
  and the taker waits a full lease from then, as its own clock measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from coalescer.common.printable import printable

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

RENEW_SHARE = 0.25  # of the claim lease: how often renewals are sent
DEADLINE_SHARE = STOP_SHARE = 0.75  # of the claim lease: how long one renewal may take,
# and how long a claim goes without a renewal getting through before it is stopped
WATCH_SHARE = 0.05  # of the claim lease: the watchdog's longest sleep
NAMED = 5  # keys named in the watchdog's log line
IN_FLIGHT = 3  # renewals awaiting an answer at once, at most
PROMPT_SHARE = 0.125  # of the claim lease: a claim call slower than this is renewed at once


class Held(Protocol):
    """What the leases need of a held claim (the runner's Job)."""

    shard: int
    renewed: float
    lost: bool

    @property
    def key(self) -> str: ...

    @property
    def token(self) -> int: ...

    @property
    def rule_name(self) -> str: ...


class ClaimLeases:
    """Renews the leases of ``jobs`` (key -> held claim); ``lose(key, token)`` stops one."""

    def __init__(self, ctx: NodeContext, jobs: Mapping[str, Held],
                 lose: Callable[[str, int | None], None]) -> None:
        self._scripts = ctx.scripts
        self._keyspace = ctx.keyspace
        self._metrics = ctx.metrics
        self._lease = ctx.claim_lease
        self._jobs = jobs
        self._lose = lose
        self._failing = False
        self._soon = asyncio.Event()  # renew now, not at the next beat

    async def run(self) -> None:
        """Renew on a fixed beat and stop what could not be renewed, until cancelled."""
        renewals: set[asyncio.Task[None]] = set()
        watchdog = asyncio.ensure_future(self._watch())
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._soon.wait(), self._lease * RENEW_SHARE)
                self._soon.clear()
                if self._jobs and len(renewals) < IN_FLIGHT:
                    task = asyncio.ensure_future(self.renew_once())
                    renewals.add(task)
                    task.add_done_callback(renewals.discard)
                    task.add_done_callback(self._answered)
                    asyncio.get_running_loop().call_later(
                        self._lease * DEADLINE_SHARE, self._overdue, task)
        finally:
            for task in (*renewals, watchdog):
                task.cancel()
            await asyncio.gather(*renewals, watchdog, return_exceptions=True)

    def claimed(self, sent: float) -> None:
        """Claims were granted by a call sent at ``sent``: when its round trip was long
        (a slow link), renew them at once rather than at the next beat."""
        if time.monotonic() - sent > self._lease * PROMPT_SHARE:
            self._soon.set()

    def _overdue(self, task: asyncio.Task[None]) -> None:
        """A renewal without an answer past its deadline is given up on: no later one
        waits for it (it is not cancelled: that would cost its connection)."""
        if not task.done():
            self._failed(TimeoutError(f"no answer within {self._lease * DEADLINE_SHARE:g}s"))

    def _answered(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            self._failed(exc)
        elif self._failing:
            log.info("renewing claim leases works again")
            self._failing = False

    def _failed(self, exc: BaseException) -> None:
        self._metrics.redis_errors.labels("renew").inc()
        if not self._failing:
            log.warning("renewing claim leases failed, will retry: %r", exc)
        self._failing = True

    async def renew_once(self) -> None:
        """One renewal of every claim held: one call per shard, all at once."""
        by_shard: dict[int, dict[str, list[tuple[str, int]]]] = defaultdict(
            lambda: defaultdict(list))
        for job in self._jobs.values():
            if not job.lost:  # a lost claim is left to its lease: never extended
                by_shard[job.shard][job.rule_name].append((job.key, job.token))
        await asyncio.gather(*(self._renew_shard(shard, groups)
                               for shard, groups in by_shard.items()))

    async def _renew_shard(self, shard: int, groups: dict[str, list[tuple[str, int]]]) -> None:
        sent = time.monotonic()
        lost = await self._scripts.renew(self._keyspace.shard(shard),
                                         round(self._lease * 1000), list(groups.items()))
        tokens = {key: token for items in groups.values() for key, token in items}
        for key in tokens.keys() - set(lost):
            held = self._jobs.get(key)
            if held is not None and held.token == tokens[key]:
                held.renewed = max(held.renewed, sent)
        for key in lost:
            self._lose(key, tokens.get(key))

    async def _watch(self) -> None:
        """Stop every claim not renewed for ``STOP_SHARE`` of the lease, on its own timer."""
        while True:
            await asyncio.sleep(self.stop_unrenewed(time.monotonic()))

    def stop_unrenewed(self, now: float) -> float:
        """Stop the claims whose lease may lapse before a renewal gets through; returns
        how long until the next one could (at most ``WATCH_SHARE`` of the lease)."""
        limit = self._lease * STOP_SHARE
        late = [job for job in self._jobs.values() if not job.lost and now - job.renewed >= limit]
        if late:
            names = ", ".join(printable(job.key) for job in late[:NAMED])
            log.warning("could not renew %d claim%s in time (%s%s): stopping their refreshes "
                        "before their lease can lapse", len(late), "" if len(late) == 1 else "s",
                        names, ", ..." if len(late) > NAMED else "")
            for job in late:
                self._lose(job.key, job.token)
        nearest = min((job.renewed + limit - now for job in self._jobs.values()
                       if not job.lost), default=self._lease)
        return max(0.01, min(self._lease * WATCH_SHARE, nearest))
