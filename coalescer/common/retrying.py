"""Exponential backoff with jitter for background loops, and log-once on error."""

from __future__ import annotations

import logging
import random
from typing import Any


class Backoff:
    """Delays that double from ``base`` to ``cap``; the first error of a run is logged
    as a warning, repeats only at debug level, so a loop that keeps failing logs once."""

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

    def log(self, logger: logging.Logger, msg: str, *args: Any) -> None:
        level = logging.DEBUG if self._failures else logging.WARNING
        logger.log(level, msg, *args)
