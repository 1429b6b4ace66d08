"""The in-process absorber between ``touch()`` and Redis.

A touched key waits in ``pending`` until the flusher writes it. While it
waits, more touches of it cost one dict lookup: they are *absorbed*, never
dropped, because the write that follows them is what makes Redis schedule the
refresh (the server stamps the write's own time, which is after every touch it
carries). A key written to Redis is remembered in ``recent`` (recent_writes.py:
cachetools TTL caches, one per absorb interval, of the keys written in each slice
of it) for about the rule's ``absorb`` interval; a key touched again while it is
recent is *held* until then, so a hot key costs at most one Redis write per absorb
interval. A key touched again while a write of it is still in flight is held
too, until that write ends (and then for its absorb interval): the flusher keeps a
few writes in flight at once, and a touch that came after a batch was taken is
written by a later one. Everything else is sent as soon as the flusher has room
for another write: writes are group-committed, one Lua call per shard.

A key is checked once, on the touch that brings it into ``pending`` (the same
place its rule is matched): a key Redis cannot store is refused there. The age of
the oldest unwritten touch is tracked per batch: ``pending`` has the time it last
went from empty to non-empty, each taken batch the stamp it left with.

A full buffer refuses ``touch`` (BackpressureError). Writers that would rather wait
``offer`` keys and wait for room: a thread on a condition, a coroutine on a future,
both woken when a write ends and its keys leave the buffer (``written``, ``discard``),
never by polling; ``write/room.py`` bounds the wait.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from coalescer.config.rules import Rule
from coalescer.errors import BackpressureError, ClosedError
from coalescer.store.keycheck import check_key
from coalescer.write.recent_writes import RecentWrites

Matcher = Callable[[str], Rule]  # key -> its Rule; raises UnknownKeyError


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Batch(dict[str, Rule]):
    """Keys taken for one write (key -> rule); ``since`` is when the oldest was touched,
    ``taken_at`` when the batch was taken, both on the ``time.monotonic()`` clock."""

    since: float
    taken_at: float


class Absorber:
    """Buffers touched keys; bounded by ``max_keys`` (G8)."""

    def __init__(self, match: Matcher, *, max_keys: int) -> None:
        self._match = match
        self._max_keys = max_keys
        self._pending: dict[str, Rule] = {}
        self._taken = 0  # keys taken for a write that has not yet succeeded or failed
        self._pending_since: float | None = None  # oldest touch in ``pending``, about
        self._taken_since: Counter[float] = Counter()  # a batch's stamp -> keys unfinished
        self._recent = RecentWrites(max_keys=max_keys)
        self._writing: list[Batch] = []  # batches taken and not yet finished (see finished)
        self._lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None
        self._room = threading.Condition(self._lock)  # notified when keys leave the buffer
        self._room_futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closing = False
        self.idle = True
        self.touches = 0
        self.absorbed = 0
        self.waits = 0  # times a waiting touch found the buffer full

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` tells the flusher there is something to send now."""
        self._wake = wake

    @property
    def max_keys(self) -> int:
        return self._max_keys

    def __len__(self) -> int:
        """Keys accepted and not yet in Redis, the ones being written included."""
        return len(self._pending) + self._taken

    def touch(self, key: str) -> None:
        """Buffer one touch of ``key``. Raises UnknownKeyError, BackpressureError."""
        if key in self._pending:
            self.touches += 1
            self.absorbed += 1
            return
        check_key(key)  # a key Redis cannot store is refused here: not counted
        rule = self._match(key)  # so is an unknown key
        self.touches += 1
        with self._lock:
            if len(self._pending) + self._taken >= self._max_keys and key not in self._pending:
                self.touches -= 1
                raise BackpressureError(
                    f"touch({key!r}) refused: {self._max_keys} keys are already buffered "
                    "and not yet written to Redis (is Redis reachable?)")
            self._pending[key] = rule
            if self._pending_since is None:
                self._pending_since = time.monotonic()
        self._poke()

    def _poke(self) -> None:
        # Wake the flusher even for a held key: it then sleeps to the key's release
        # time, instead of its idle check, so the touch is written within ``absorb``.
        if self.idle:
            self.idle = False
            self._wake()

    # -- waiting for room (see write/room.py) --

    def rules_of(self, keys: list[str]) -> list[tuple[str, Rule]]:
        """Each key with its rule; a refused key raises (KeyRefusedError) before any
        key is buffered."""
        return [(key, self._rule(key)) for key in keys]

    def offer(self, items: list[tuple[str, Rule]], start: int) -> int:
        """Buffer ``items[start:]`` in order while there is room; returns the index of
        the first one left out (``len(items)``: all are in). Raises ClosedError once
        ``close_waits`` was called."""
        with self._lock:
            if self._closing:
                raise ClosedError("touch refused: the coalescer is closing")
            i = self._offer_locked(items, start)
        if i > start:
            self._poke()
        return i

    def _offer_locked(self, items: list[tuple[str, Rule]], start: int) -> int:
        pending, room = self._pending, self._max_keys - len(self._pending) - self._taken
        i = start
        while i < len(items):
            key, rule = items[i]
            if key not in pending:
                if room <= 0:
                    break
                room -= 1
                pending[key] = rule
                if self._pending_since is None:
                    self._pending_since = time.monotonic()
            else:
                self.absorbed += 1
            self.touches += 1
            i += 1
        return i

    def wait_room(self, timeout: float | None) -> bool:
        """Block this thread until some room is freed (or ``close_waits``); False when
        ``timeout`` seconds passed first. Never call it on the flusher's event loop."""
        with self._lock:
            if self._closing or len(self._pending) + self._taken < self._max_keys:
                return True
            self.waits += 1
            return self._room.wait(timeout)

    def room_future(self) -> asyncio.Future[None]:
        """A future of the running loop, done once room is freed (at once if there is
        some now, or once ``close_waits`` is called)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._closing or len(self._pending) + self._taken < self._max_keys:
                future.set_result(None)
            else:
                self.waits += 1
                self._room_futures.append((loop, future))
        return future

    def close_waits(self) -> None:
        """The coalescer is closing: every waiting touch ends (with ClosedError)."""
        with self._lock:
            self._closing = True
            self._freed_locked()

    def _freed_locked(self) -> None:
        """Room was freed: wake the waiting threads and coroutines (lock held)."""
        self._room.notify_all()
        futures, self._room_futures = self._room_futures, []
        for loop, future in futures:
            loop.call_soon_threadsafe(_resolve, future)

    def touch_many(self, keys: list[str]) -> None:
        """Buffer every key or none: a refused key (KeyRefusedError) or BackpressureError
        applies nothing."""
        rules = {key: self._rule(key) for key in keys}
        with self._lock:
            new = [key for key in rules if key not in self._pending]
            if len(self._pending) + self._taken + len(new) > self._max_keys:
                raise BackpressureError(
                    f"{len(new)} new keys refused: {len(self._pending)} keys are already "
                    f"buffered (the bound is {self._max_keys}) and not yet written to Redis "
                    "(is Redis reachable?)")
            self._pending.update(rules)
            if new and self._pending_since is None:
                self._pending_since = time.monotonic()
            fresh = bool(new)  # held keys too (see touch)
            self.touches += len(keys)
            self.absorbed += len(keys) - len(new)
        if fresh and self.idle:
            self.idle = False
            self._wake()

    def drop(self, keys: Iterable[str]) -> set[str]:
        """Forget the buffered touches of ``keys`` that no write has taken yet (a cancel
        drops them); returns the keys that had some."""
        with self._lock:
            gone = {key for key in keys if self._pending.pop(key, None) is not None}
            if not self._pending:
                self._pending_since = None
            if gone:
                self._freed_locked()
        return gone

    def _rule(self, key: str) -> Rule:
        check_key(key)
        return self._match(key)

    def take(self, *, everything: bool = False) -> Batch:
        """Remove and return the keys ready to write (all of them with ``everything``)."""
        with self._lock:
            ready = Batch()
            ready.taken_at = time.monotonic()
            ready.since = self._pending_since or ready.taken_at
            if everything:
                ready.update(self._pending)
                self._pending = {}
                self._pending_since = None
            else:
                self._pending, self._pending_since = self._split_ready(ready)
            if ready:
                self._taken += len(ready)
                self._taken_since[ready.since] += len(ready)
                self._writing.append(ready)
            return ready

    def finished(self, batch: Batch) -> None:
        """The write of ``batch`` is over (each key written, given back or discarded):
        its keys are no longer held for being in flight. Idempotent."""
        self._writing = [b for b in self._writing if b is not batch]

    def _split_ready(self, ready: Batch) -> tuple[dict[str, Rule], float | None]:
        """Move the keys that are not held into ``ready``; the held keys and their stamp."""
        holds = self._holds(self._pending)
        if not holds:
            ready.update(self._pending)
            return {}, None
        held: dict[str, Rule] = {}
        for key, rule in self._pending.items():
            if key in holds:
                held[key] = rule
            else:
                ready[key] = rule
        since = min(holds.values())
        if self._pending_since is not None:
            since = max(since, self._pending_since)
        return held, since

    def _holds(self, keys: Mapping[str, Rule]) -> dict[str, float]:
        """The keys of ``keys`` to hold, each with the earliest its touch can have been.

        A key being written was touched after its batch was taken; a key written
        lately, no earlier than about when that write ended (its ``recent`` expiry
        minus its ``absorb``).
        """
        holds = {key: batch.taken_at for batch in reversed(self._writing)  # earliest wins
                 for key in batch.keys() & keys.keys()}
        for key, expiry in self._recent.expiries(keys).items():
            if key not in holds:
                holds[key] = expiry - keys[key].absorb
        return holds

    def _finish(self, batch: Mapping[str, Rule], since: float | None) -> None:
        """Account for keys of a taken batch that are no longer being written (the
        batch itself, as taken, is then finished)."""
        self._taken -= len(batch)
        if isinstance(batch, Batch):
            self.finished(batch)
        stamp = since if since is not None else getattr(batch, "since", None)
        if stamp is None:
            return
        left = self._taken_since[stamp] - len(batch)
        if left > 0:
            self._taken_since[stamp] = left
        else:
            del self._taken_since[stamp]

    def written(self, batch: Mapping[str, Rule], since: float | None = None) -> None:
        """Remember keys as written: they are recent for their absorb interval.

        ``since`` is the stamp of the batch they were taken in (default ``batch.since``).
        """
        with self._lock:
            self._finish(batch, since)
            self._freed_locked()
        # ``recent`` is only used from the event loop's thread (take, written,
        # next_ready_in), so filling it needs no lock: touch() is never kept waiting.
        self._recent.add(batch)

    def give_back(self, batch: Mapping[str, Rule], since: float | None = None) -> None:
        """Return unwritten keys to the buffer; nothing accepted is lost."""
        with self._lock:
            self._finish(batch, since)
            for key, rule in batch.items():
                self._pending.setdefault(key, rule)
            stamp = since if since is not None else getattr(batch, "since", None)
            if batch and stamp is not None:
                old = self._pending_since
                self._pending_since = stamp if old is None else min(old, stamp)

    def discard(self, batch: Mapping[str, Rule], since: float | None = None) -> None:
        """Forget keys that can never be written (the flusher dropped them)."""
        with self._lock:
            self._finish(batch, since)
            self._freed_locked()

    def oldest_unwritten(self) -> float | None:
        """When the oldest touch not yet in Redis was made (``time.monotonic()``), or None."""
        with self._lock:
            stamps = list(self._taken_since)
            if self._pending and self._pending_since is not None:
                stamps.append(self._pending_since)
        return min(stamps) if stamps else None

    def next_ready_in(self) -> float | None:
        """Seconds until a held key may be written, or None when none is held or every
        held key waits for a write in flight to end."""
        with self._lock:
            if not self._pending:
                return None
            pending = dict(self._pending)
        writing = {key for batch in self._writing for key in batch.keys() & pending.keys()}
        expiries = self._recent.expiries(pending)
        waits = [expiries.get(key, 0.0) for key in pending if key not in writing]
        if not waits:
            return None
        return max(0.0, min(waits) - time.monotonic())
