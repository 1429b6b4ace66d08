"""The one loop of every background task: survives errors, logs once, backs off."""

from __future__ import annotations

import asyncio
import logging

import pytest

from coalescer.common.retrying import Backoff, keep_running

LOGGER = logging.getLogger("tests.retrying")


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER.name]


class Flaky:
    """A step that fails ``failures`` times, then succeeds; stops the loop after
    ``runs`` successes."""

    def __init__(self, failures: int, runs: int = 1) -> None:
        self.failures = failures
        self.runs = runs
        self.calls = 0
        self.successes = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError(f"down ({self.calls})")
        self.successes += 1

    def done(self) -> bool:
        return self.successes >= self.runs


async def no_pause(delay: float) -> None:
    await asyncio.sleep(0)


async def test_two_failures_are_logged_once_retried_and_the_recovery_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    step = Flaky(failures=2)
    errors: list[Exception] = []
    await keep_running("the sync", step, logger=LOGGER, on_error=errors.append,
                       pause=no_pause, stop=step.done)
    assert step.calls == 3
    assert [str(e) for e in errors] == ["down (1)", "down (2)"]
    assert lines(caplog) == [
        (logging.WARNING, "the sync failed, will retry: ConnectionError('down (1)')"),
        (logging.DEBUG, "the sync failed, will retry: ConnectionError('down (2)')"),
        (logging.INFO, "the sync works again after 2 failed attempts"),
    ]


async def test_a_success_resets_the_backoff_so_the_next_error_warns_again(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER.name)
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls in (1, 3):
            raise RuntimeError(f"bug {calls}")
    await keep_running("job", step, logger=LOGGER, pause=no_pause, stop=lambda: calls >= 4)
    assert [m for _, m in lines(caplog)] == ["job failed, will retry: RuntimeError('bug 1')",
                                             "job failed, will retry: RuntimeError('bug 3')"]


async def test_the_pauses_double_from_the_base_up_to_the_cap() -> None:
    step = Flaky(failures=5)
    pauses: list[float] = []

    async def pause(delay: float) -> None:
        pauses.append(delay)
    await keep_running("job", step, backoff=Backoff(base=1.0, cap=4.0), logger=LOGGER,
                       pause=pause, stop=step.done)
    limits = [1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(pauses) == len(limits)
    assert all(limit / 2 <= p <= limit for p, limit in zip(pauses, limits, strict=True))


async def test_quiet_loops_log_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    step = Flaky(failures=1)
    await keep_running("shard 3", step, logger=LOGGER, pause=no_pause, stop=step.done,
                       quiet=True)
    assert len(lines(caplog)) == 2
    assert {level for level, _ in lines(caplog)} == {logging.DEBUG}


async def test_rest_runs_after_each_success_only() -> None:
    step = Flaky(failures=1, runs=2)
    rests: list[int] = []

    async def rest() -> None:
        rests.append(step.calls)
    await keep_running("job", step, logger=LOGGER, pause=no_pause, rest=rest, stop=step.done)
    assert rests == [2, 3]


async def test_cancellation_stops_the_loop() -> None:
    started = asyncio.Event()
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.Event().wait()  # blocks until cancelled
    task = asyncio.create_task(keep_running("job", step, logger=LOGGER))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1


async def test_a_cancelled_pause_stops_a_failing_loop() -> None:
    paused = asyncio.Event()

    async def step() -> None:
        raise ConnectionError("down")

    async def pause(delay: float) -> None:
        paused.set()
        await asyncio.Event().wait()  # blocks until cancelled
    task = asyncio.create_task(keep_running("job", step, logger=LOGGER, pause=pause))
    await paused.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
