"""A log line per kind of event at most once a minute: a flood of one bad input
costs one line a minute, with the count of the others since."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY = 60.0  # seconds between two lines of one kind
KINDS = 1000  # kinds remembered at most (past it, the oldest are forgotten)


class LogOnce:
    """Logs a line of a kind (any string: a source and an exception's type) when no
    line of that kind was logged in the last ``every`` seconds; counts the others and
    says how many were left out in the next line of that kind."""

    def __init__(self, logger: logging.Logger, *, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._every = every
        self._clock = clock
        self._last: dict[str, float] = {}  # kind -> when its last line was logged
        self._skipped: dict[str, int] = {}  # kind -> lines left out since

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` as a warning unless a line of ``kind`` was logged
        lately; whether it was logged."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._every:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        skipped = self._skipped.pop(kind, 0)
        if len(self._last) >= KINDS and kind not in self._last:
            oldest = min(self._last, key=self._last.__getitem__)
            del self._last[oldest]
            self._skipped.pop(oldest, None)
        self._last[kind] = now
        if skipped:
            message += " (and %d more like it, not logged, since the last such line)"
            args = (*args, skipped)
        self._logger.warning(message, *args)
        return True
