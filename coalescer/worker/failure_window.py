"""How this node's recent refreshes ended: the evidence that its runs fail as a whole.

The window holds the last ``RUNS`` finished runs of this node, those of the last
``SECONDS`` only. It judges the node unhealthy when at least ``MIN_RUNS`` runs are
in it, at least ``RATIO`` of them failed, and the failures span at least ``MIN_KEYS``
distinct keys: a key (or a few) that fails every time, however often it is retried,
never makes the node unhealthy; a node on which nearly every key fails does. A run
counts as failed when its handler raised, ran past its timeout or never started.
Every update is O(1) (the counts are kept as runs come and go).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

RUNS = 100  # finished runs the window holds at most
SECONDS = 60.0  # and only those finished this recently
MIN_RUNS = 10  # fewer runs than this in the window: no verdict (healthy)
MIN_KEYS = 5  # failures of fewer distinct keys: healthy, whatever the ratio
RATIO = 0.9  # the share of failed runs at or above which the node is unhealthy


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Why the window judges the node unhealthy: its counts, over ``seconds``."""

    failed: int
    runs: int
    keys: int  # distinct keys among the failures
    seconds: float  # from the oldest run in the window to now

    def text(self) -> str:
        return (f"{self.failed} of its last {self.runs} refreshes failed "
                f"({self.keys} distinct keys, in {self.seconds:.0f}s)")


class FailureWindow:
    """The last finished runs of this node, with their failure counts."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._runs: deque[tuple[float, str, bool]] = deque()  # (finished, key, failed)
        self._failed_keys: Counter[str] = Counter()
        self._failed = 0

    def __len__(self) -> int:
        return len(self._runs)

    def record(self, key: str, *, failed: bool) -> None:
        """A run of ``key`` finished (``failed``: it did not succeed)."""
        now = self._clock()
        self._runs.append((now, key, failed))
        if failed:
            self._failed += 1
            self._failed_keys[key] += 1
        if len(self._runs) > RUNS:
            self._pop()
        self._age(now)

    def verdict(self) -> Verdict | None:
        """Why the node is unhealthy now, or None when it is not (or too few runs)."""
        now = self._clock()
        self._age(now)
        runs = len(self._runs)
        keys = len(self._failed_keys)
        if runs < MIN_RUNS or keys < MIN_KEYS or self._failed < RATIO * runs:
            return None
        return Verdict(failed=self._failed, runs=runs, keys=keys,
                       seconds=now - self._runs[0][0])

    def healthy(self) -> bool:
        """Enough runs in the window to judge, and they do not make the node unhealthy."""
        return len(self._runs) >= MIN_RUNS and self.verdict() is None

    def clear(self) -> None:
        self._runs.clear()
        self._failed_keys.clear()
        self._failed = 0

    def _age(self, now: float) -> None:
        while self._runs and self._runs[0][0] < now - SECONDS:
            self._pop()

    def _pop(self) -> None:
        _, key, failed = self._runs.popleft()
        if failed:
            self._failed -= 1
            left = self._failed_keys[key] - 1
            if left:
                self._failed_keys[key] = left
            else:
                del self._failed_keys[key]
