"""The keys written to Redis lately, each remembered for its rule's absorb interval, in
time slices of an eighth of it, one cachetools ``TTLCache`` per interval: why, and how
long a key stays recent, is docs/concepts.md's "Absorber". An entry is one slice (the
keys written during it), created by the slice's first write and expiring ``absorb``
later. Only the event loop's thread uses it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cachetools import TTLCache

from coalescer.config.rules import Rule

SLICES = 8  # slices per absorb interval: a key is recent for at least 7/8 of it


class RecentWrites:
    """Recently written keys (key -> when it stops being recent, ``time.monotonic()``)."""

    def __init__(self, *, max_keys: int) -> None:
        self._max_keys = max_keys
        # absorb interval -> slice number -> (expiry, keys written in that slice)
        self._caches: dict[float, TTLCache[int, tuple[float, dict[str, Rule]]]] = {}

    def add(self, batch: Mapping[str, Rule]) -> None:
        """Remember ``batch``'s keys (key -> rule) as written now."""
        if not batch:
            return
        rules = batch.values()
        by_id = dict(zip(map(id, rules), rules, strict=True))  # few rules: no per-key hash
        intervals = {rule.absorb for rule in by_id.values()}
        if len(intervals) == 1:
            self._add(intervals.pop(), batch)
            return
        for absorb in intervals:
            self._add(absorb, {k: r for k, r in batch.items() if r.absorb == absorb})

    def _add(self, absorb: float, keys: Mapping[str, Rule]) -> None:
        if absorb <= 0:  # absorb 0s: no key is held back after its write
            return
        cache = self._caches.get(absorb)
        if cache is None:
            cache = self._caches[absorb] = TTLCache(maxsize=SLICES + 2, ttl=absorb)
        with cache.timer as now:
            slot = math.floor(now * SLICES / absorb)
            entry = cache.get(slot)
            if entry is None:
                cache[slot] = (now + absorb, dict(keys))
            else:
                entry[1].update(keys)
        self._bound()

    def _bound(self) -> None:
        """Forget the oldest slices while more than ``max_keys`` keys are remembered: a
        forgotten key is only written again sooner."""
        while sum(len(k) for _, k in self._live()) > self._max_keys:
            oldest = min(self._caches.values(), key=_first_expiry)
            oldest.popitem()

    def _live(self) -> list[tuple[float, dict[str, Rule]]]:
        """The live slices, latest expiry first."""
        live: list[tuple[float, dict[str, Rule]]] = []
        for cache in self._caches.values():
            cache.expire()
            live.extend(cache.values())
        live.sort(key=_expiry, reverse=True)
        return live

    def expiries(self, keys: Mapping[str, Rule]) -> dict[str, float]:
        """When each of ``keys`` that is recent stops being so (the others are left out)."""
        out: dict[str, float] = {}
        for expiry, written in self._live():
            for key in written.keys() & keys.keys():
                out.setdefault(key, expiry)
        return out

    def __len__(self) -> int:
        return sum(len(k) for _, k in self._live())


def _expiry(entry: tuple[float, dict[str, Rule]]) -> float:
    return entry[0]


def _first_expiry(cache: TTLCache[int, tuple[float, dict[str, Rule]]]) -> float:
    return min((e for e, _ in cache.values()), default=math.inf)
