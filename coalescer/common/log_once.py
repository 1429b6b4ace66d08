"""A log line per kind of event at most once a minute (or a few, ``lines``): a flood of
one bad input costs a line or a few a minute, with the count of the others since."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY = 60.0  # seconds: the window in which a kind has its lines
KINDS = 1000  # kinds remembered at most (past it, the oldest are forgotten)


class LogOnce:
    """Logs a line of a kind (any string: a source and an exception's type) unless
    ``lines`` lines of that kind were logged in its window (``every`` seconds from its
    first line); counts the others and says how many were left out in the next line of
    that kind."""

    def __init__(self, logger: logging.Logger, *, every: float = EVERY, lines: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._every = every
        self._lines = lines
        self._clock = clock
        self._window: dict[str, tuple[float, int]] = {}  # kind -> its window's start, lines
        self._skipped: dict[str, int] = {}  # kind -> lines left out since

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` as a warning unless the lines of ``kind`` are used up
        for now; whether it was logged."""
        now = self._clock()
        start, used = self._window.get(kind, (now, 0))
        if now - start >= self._every:
            start, used = now, 0
        if used >= self._lines:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        if len(self._window) >= KINDS and kind not in self._window:
            oldest = min(self._window, key=lambda known: self._window[known][0])
            del self._window[oldest]
            self._skipped.pop(oldest, None)
        self._window[kind] = (start, used + 1)
        skipped = self._skipped.pop(kind, 0)
        if skipped:
            message += " (and %d more like it, not logged, since the last such line)"
            args = (*args, skipped)
        self._logger.warning(message, *args)
        return True
