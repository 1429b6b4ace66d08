"""Exponential backoff with jitter, and the one loop every background task runs.

``keep_running`` runs a step again and again until it is cancelled (or told to
stop). A step that raises does not end the loop: the first error of a run of
errors is logged once as a warning with the loop's name, repeats only at debug
level, and the loop backs off (doubling, with jitter) before the next step. The
first step that succeeds after errors logs the recovery once and resets the
backoff. Cancellation is never caught.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from coalescer.common.plural import plural

log = logging.getLogger(__name__)


class Backoff:
    """Delays that double from ``base`` to ``cap``, each jittered down to half of it;
    ``reset()`` after a success starts again from ``base``."""

    def __init__(self, base: float = 0.05, cap: float = 2.0) -> None:
        self._base = base
        self._cap = cap
        self._failures = 0

    def next(self) -> float:
        delay = min(self._cap, self._base * 2 ** self._failures)
        self._failures += 1
        return float(delay * random.uniform(0.5, 1.0))

    def reset(self) -> None:
        self._failures = 0

    @property
    def failing(self) -> bool:
        return self._failures > 0

    @property
    def failures(self) -> int:
        """How many errors in a row since the last success."""
        return self._failures


def _never() -> bool:
    return False


async def keep_running(name: str, step: Callable[[], Awaitable[object]], *,
                       backoff: Backoff | None = None, logger: logging.Logger = log,
                       on_error: Callable[[Exception], object] | None = None,
                       pause: Callable[[float], Awaitable[object]] = asyncio.sleep,
                       rest: Callable[[], Awaitable[object]] | None = None,
                       stop: Callable[[], bool] = _never, quiet: bool = False) -> None:
    """Run ``step`` until cancelled or until ``stop()`` is true before a step.

    After an error, ``on_error`` is called with it (before the backoff counts it,
    so ``backoff.failing`` tells whether it is the first of a run), and the loop
    waits ``pause(delay)``; after a success, it waits ``rest()`` if given (a loop
    that works on a period). ``quiet`` logs every line at debug level, for loops whose
    caller summarises their errors itself.
    """
    backoff = backoff if backoff is not None else Backoff()
    loud = logging.DEBUG if quiet else logging.WARNING
    while not stop():
        try:
            await step()
        except Exception as exc:  # Redis down, or a bug: the loop goes on (logged once)
            if on_error is not None:
                on_error(exc)
            level = logging.DEBUG if backoff.failing else loud
            logger.log(level, "%s failed, will retry: %r", name, exc)
            await pause(backoff.next())
            continue
        if backoff.failing:
            logger.log(logging.DEBUG if quiet else logging.INFO, "%s works again after %s",
                       name, plural(backoff.failures, "failed attempt"))
        backoff.reset()
        if rest is not None:
            await rest()
