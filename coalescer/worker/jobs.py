"""What the runner holds: a claim of this node with its run (``Job``), and the claims
started together, which share one timeout timer (``Batch``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from coalescer.claim import Claim
from coalescer.config.rules import Rule


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

