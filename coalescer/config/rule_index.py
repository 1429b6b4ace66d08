"""Which rule matches a key first: rules bucketed by the literal text their pattern starts
with, so a key is tried only against the rules whose start it has, in file order."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from coalescer.config.patterns import KeyPattern


class RuleIndex:
    """The patterns of a rules file, in match order (the first match wins)."""

    def __init__(self, patterns: Sequence[KeyPattern]) -> None:
        self._patterns = tuple(patterns)
        buckets: dict[str, list[int]] = {}
        for number, pattern in enumerate(self._patterns):
            buckets.setdefault(pattern.prefix, []).append(number)
        self._buckets = buckets
        self._lengths = sorted({len(prefix) for prefix in buckets})

    def first(self, key: str) -> tuple[int, dict[str, str]] | None:
        """The number of the first pattern matching ``key`` and its captures, or None."""
        candidates = [bucket for length in self._lengths if length <= len(key)
                      if (bucket := self._buckets.get(key[:length])) is not None]
        for number in heapq.merge(*candidates):
            found = self._patterns[number].match(key)
            if found is not None:
                return number, found
        return None
