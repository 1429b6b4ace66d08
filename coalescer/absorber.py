"""The in-process absorber between ``touch()`` and Redis.

A touched key waits in ``pending`` until the flusher writes it. While it
waits, more touches of it cost one dict lookup: they are *absorbed*, never
dropped, because the write that follows them is what makes Redis schedule the
refresh (the server stamps the write's own time, which is after every touch it
carries). A key written to Redis is remembered in ``recent``, a cachetools
time-aware cache whose entries live for the rule's ``absorb`` interval; a key
touched again while it is recent is *held* until its entry expires, so a hot key
costs at most one Redis write per absorb interval. Everything else is sent as
soon as the flusher is free: writes are group-committed, one Lua call per shard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from cachetools import TLRUCache

from .errors import BackpressureError

Matcher = Callable[[str], Any]  # key -> its Rule; raises UnknownKeyError


def _expires(_key: str, expiry: float, _now: float) -> float:
    return expiry


class Absorber:
    """Buffers touched keys; bounded by ``max_keys`` (G8)."""

    def __init__(self, match: Matcher, *, max_keys: int) -> None:
        self._match = match
        self._max_keys = max_keys
        self._pending: dict[str, Any] = {}
        self._taken = 0  # keys taken for a write that has not yet succeeded or failed
        self._recent: TLRUCache[str, float] = TLRUCache(maxsize=max_keys, ttu=_expires)
        self._lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None
        self.idle = True
        self.touches = 0
        self.absorbed = 0

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` tells the flusher there is something to send now."""
        self._wake = wake

    def __len__(self) -> int:
        """Keys accepted and not yet in Redis, the ones being written included."""
        return len(self._pending) + self._taken

    def touch(self, key: str) -> None:
        """Buffer one touch of ``key``. Raises UnknownKeyError, BackpressureError."""
        if key in self._pending:
            self.touches += 1
            self.absorbed += 1
            return
        rule = self._match(key)  # an unknown key is refused here: not counted
        self.touches += 1
        with self._lock:
            if len(self._pending) + self._taken >= self._max_keys and key not in self._pending:
                self.touches -= 1
                raise BackpressureError(
                    f"touch({key!r}) refused: {self._max_keys} keys are already buffered "
                    "and not yet written to Redis (is Redis reachable?)")
            self._pending[key] = rule
        # Wake the flusher even for a held key: it then sleeps to the key's release
        # time, instead of its idle check, so the touch is written within ``absorb``.
        if self.idle:
            self.idle = False
            self._wake()

    def touch_many(self, keys: list[str]) -> None:
        """Buffer every key or none: UnknownKeyError or BackpressureError apply nothing."""
        rules = {key: self._match(key) for key in keys}
        with self._lock:
            new = [key for key in rules if key not in self._pending]
            if len(self._pending) + self._taken + len(new) > self._max_keys:
                raise BackpressureError(
                    f"{len(new)} new keys refused: {len(self._pending)} keys are already "
                    f"buffered (the bound is {self._max_keys}) and not yet written to Redis "
                    "(is Redis reachable?)")
            self._pending.update(rules)
            fresh = bool(new)  # held keys too (see touch)
            self.touches += len(keys)
            self.absorbed += len(keys) - len(new)
        if fresh and self.idle:
            self.idle = False
            self._wake()

    def take(self, *, everything: bool = False) -> dict[str, Any]:
        """Remove and return the keys ready to write (all of them with ``everything``)."""
        with self._lock:
            if everything:
                ready, self._pending = self._pending, {}
                self._taken += len(ready)
                return ready
            ready = {}
            held = {}
            for key, rule in self._pending.items():
                if key in self._recent:
                    held[key] = rule
                else:
                    ready[key] = rule
            self._pending = held
            self._taken += len(ready)
            return ready

    def written(self, batch: dict[str, Any]) -> None:
        """Remember a batch as written: its keys are recent for their absorb interval."""
        with self._lock:
            self._taken -= len(batch)
        # ``recent`` is only used from the event loop's thread (take, written,
        # next_ready_in), so filling it needs no lock: touch() is never kept waiting.
        recent, now = self._recent, time.monotonic()
        for key, rule in batch.items():
            recent[key] = now + rule.absorb

    def give_back(self, batch: dict[str, Any]) -> None:
        """Return an unwritten batch to the buffer; nothing accepted is lost."""
        with self._lock:
            self._taken -= len(batch)
            for key, rule in batch.items():
                self._pending.setdefault(key, rule)

    def next_ready_in(self) -> float | None:
        """Seconds until a held key may be written, or None when none is held."""
        with self._lock:
            if not self._pending:
                return None
            expiries = [self._recent.get(key) for key in self._pending]
        if any(e is None for e in expiries):
            return 0.0
        return max(0.0, min(e for e in expiries if e is not None) - time.monotonic())
