"""How often a node logs refresh failures: one line per kind of failure (what went
wrong, of which rule) per period, the first of the period with its traceback; the
failures of the same kind within the period are counted, and the next line of that kind
says how many were left out. Many keys failing the same way cost a few lines a minute,
not a traceback each."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cachetools import LRUCache

PERIOD = 60.0  # seconds: one line per kind of failure in each
KINDS = 10_000  # kinds remembered (a kind forgotten logs at its next failure)

Kind = tuple[str, ...]


@dataclass(slots=True)
class _Seen:
    since: float  # when the last line of the kind was logged
    left_out: int = 0  # failures of the kind not logged since


class FailureLog:
    """Which failures to log, and how many of their kind were left out."""

    def __init__(self, period: float = PERIOD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._kinds: LRUCache[Kind, _Seen] = LRUCache(KINDS)

    def admit(self, kind: Kind) -> int | None:
        """None when this failure is left out (counted); else it is logged, and the
        number of failures of its kind left out since the kind's last line."""
        now = self._clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.since < self.period:
            seen.left_out += 1
            return None
        self._kinds[kind] = _Seen(now)
        return 0 if seen is None else seen.left_out

    def note(self, left_out: int) -> str:
        """What a line adds about the failures of its kind left out before it."""
        if not left_out:
            return ""
        return (f" ({left_out} more of this kind in the last {self.period:g}s were not "
                "logged: see coalescer_refreshes_total, `coalescer history --failed`)")
