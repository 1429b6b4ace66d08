"""A worker's periodic INFO line: what it refreshed since the last line (its text and
when it is logged: docs/cli.md, "What a node logs about refreshes"). Successes are
logged at DEBUG only, so without this a worker's terminal stays silent however much it
refreshes. ``tick()`` runs about once a second, ``tick(final=True)`` at close. The
counts are the runner's own per-rule figures (``RuleMetrics``); the lags are the upper
bounds of their histogram buckets. While rules' rates hold due keys back, the line ends
with ", N keys waiting for their rule's rate".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coalescer.common.metrics import Metrics, RuleMetrics
from coalescer.common.plural import plural

log = logging.getLogger(__name__)

EVERY = 10.0  # seconds between two lines, at least


@dataclass(frozen=True, slots=True)
class Counts:
    """The figures of every rule of a node added up, at one moment."""

    refreshes: int = 0
    failed: int = 0
    dead: int = 0
    lags: tuple[int, ...] = ()  # start lags per bucket (not cumulative)

    @classmethod
    def of(cls, rules: Sequence[RuleMetrics]) -> Counts:
        lags = [0] * len(rules[0].start_lag.counts) if rules else []
        refreshes = failed = dead = 0
        for m in rules:
            refreshes += sum(m.outcomes.values())
            failed += m.outcomes["failure"] + m.outcomes["timeout"]
            dead += m.dead_lettered
            lags = [a + b for a, b in zip(lags, m.start_lag.counts, strict=True)]
        return cls(refreshes, failed, dead, tuple(lags))

    def since(self, before: Counts) -> Counts:
        old = before.lags or (0,) * len(self.lags)
        return Counts(self.refreshes - before.refreshes, self.failed - before.failed,
                      self.dead - before.dead,
                      tuple(a - b for a, b in zip(self.lags, old, strict=True)))


def bound_text(bound: str) -> str:
    """A bucket's upper bound (seconds, or "+Inf") for people: "<=5 ms", ">10 s"."""
    if bound == "+Inf":
        return ">10 s"
    seconds = float(bound)
    return f"<={seconds * 1000:g} ms" if seconds < 1 else f"<={seconds:g} s"


def lag_text(lags: Sequence[int], bounds: Sequence[str]) -> str:
    """"start lag p50 <=X, max <=Y" of per-bucket counts; "" when none was observed."""
    total = sum(lags)
    if total == 0:
        return ""
    half, running, p50 = math.ceil(total / 2), 0, len(lags) - 1
    for i, n in enumerate(lags):
        running += n
        if running >= half:
            p50 = i
            break
    top = max(i for i, n in enumerate(lags) if n)
    return f", start lag p50 {bound_text(bounds[p50])}, max {bound_text(bounds[top])}"


class RefreshSummary:
    """Logs one node's refresh counts now and then."""

    def __init__(self, node_id: str, metrics: Metrics, rules: Sequence[str], *,
                 every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self._node_id = node_id
        self._metrics = metrics
        self._rules = [metrics.rule(name) for name in rules]
        self._every = every
        self._clock = clock
        self._last = Counts.of(self._rules)
        self._since = clock()

    def tick(self, *, final: bool = False) -> None:
        """Log the counts since the last line, if one is due and something happened."""
        now = self._clock()
        if not final and now - self._since < self._every:
            return
        counts = Counts.of(self._rules)
        new = counts.since(self._last)
        if new.refreshes or new.dead:
            self._log(new, now - self._since)
        self._last, self._since = counts, now

    def _log(self, new: Counts, seconds: float) -> None:
        bounds = [b for b, _ in self._rules[0].start_lag.buckets()] if self._rules else []
        dead = f", {new.dead} dead-lettered" if new.dead else ""
        held = self._metrics.held_by_rate()
        rate = f", {plural(held, 'key')} waiting for their rule's rate" if held else ""
        log.info("coalescer %s: %s in the last %ds (%d failed%s)%s%s", self._node_id,
                 plural(new.refreshes, "refresh", "refreshes"), round(seconds), new.failed,
                 dead, lag_text(new.lags, bounds), rate)
