"""The refresh handlers the benchmarks run, and what they record.

In-process workloads use ``refresh``: it records each refresh's start time
(client clock, epoch seconds) and start lag, then optionally sleeps to model
work. ``logged`` is for subprocess nodes: it appends "TIME KEY" lines to the
file named by $BENCH_REFRESH_LOG; ``buffered`` writes the same lines in batches,
one file per process (for drains, where a write per refresh would cost).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import random
import time
from collections import defaultdict
from typing import Any, TextIO


class Recorder:
    """Refresh starts of one workload. ``offset_ms`` converts claim.due_ms to this clock."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, *, offset_ms: float = 0.0, work: float = 0.0) -> None:
        # the latest start per key and the count per key: plain floats and ints, so
        # recording adds no objects for the garbage collector to scan
        self.starts: dict[str, float] = {}
        self.per_key: dict[str, int] = defaultdict(int)
        self.lags_ms: list[float] = []
        self.offset_ms = offset_ms  # server clock minus client clock, ms
        self.work = work  # a refresh sleeps uniformly in [0, work] seconds
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.running = 0

    def started(self, key: str, due_ms: float) -> float:
        now = time.time()
        self.starts[key] = now
        self.per_key[key] += 1
        self.lags_ms.append(now * 1000.0 - (due_ms - self.offset_ms))
        self.count += 1
        if self.first is None:
            self.first = now
        self.last = now
        return now

    async def refresh(self, key: str, due_ms: float) -> None:
        """Record the start, then do up to ``work`` seconds of pretend work."""
        self.started(key, due_ms)
        if self.work > 0:
            self.running += 1
            try:
                await asyncio.sleep(random.uniform(0, self.work))
            finally:
                self.running -= 1


REC = Recorder()


async def refresh(claim: Any) -> None:
    """A refresh handler: record the start, then do ``REC.work`` of pretend work."""
    await REC.refresh(claim.key, claim.due_ms)


async def noop(claim: Any) -> None:
    """A refresh handler that does nothing (subprocess drains count what Redis holds)."""


_LOG: dict[str, TextIO] = {}


async def logged(claim: Any) -> None:
    """A refresh handler for subprocess nodes: one "TIME KEY" line per refresh start."""
    log = _LOG.get("file")
    if log is None:
        log = _LOG["file"] = open(os.environ["BENCH_REFRESH_LOG"], "a", buffering=1)  # noqa: SIM115
    log.write(f"{time.time():.6f} {claim.key}\n")


_LINES: list[str] = []
BATCH = 10_000


async def buffered(claim: Any) -> None:
    """As ``logged``, written every 10,000 refreshes and at exit to "$BENCH_REFRESH_LOG.PID"."""
    if not _LINES:
        atexit.register(_write_lines)  # once per batch: _write_lines unregisters it
    _LINES.append(f"{time.time():.6f} {claim.key}\n")
    if len(_LINES) >= BATCH:
        _write_lines()


def _write_lines() -> None:
    atexit.unregister(_write_lines)
    if _LINES:
        with open(f"{os.environ['BENCH_REFRESH_LOG']}.{os.getpid()}", "a") as f:
            f.write("".join(_LINES))
        _LINES.clear()


def read_log(path: str | os.PathLike[str]) -> list[tuple[float, str]]:
    """The (time, key) lines of a ``logged`` file; a torn last line is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and line.endswith("\n"):
                    out.append((float(parts[0]), parts[1]))
    except FileNotFoundError:
        pass
    return out
