"""Backpressure on the buffer: what a full one refuses, waiting for room, and the gate
that lets the flusher's thread in.

A full buffer refuses ``touch`` (BackpressureError). Writers that would rather wait
``offer`` keys and wait for room: a thread on a condition, a coroutine on a future,
both woken when a write ends and its keys leave the buffer (``written``, ``discard``),
never by polling; ``write/room.py`` bounds the wait.

The gate: threads that touch without pause keep the GIL from the flusher's loop (docs/
python-api.md, "Many threads", says what that cost and what a touch then does). So once
more than ``GATE_BACKLOG`` new keys came in since the flusher last took what was ready,
a touch of a new key waits (at most ``GATE_WAIT``) until it takes again; yielding the
GIL instead (``time.sleep(0)``) most often handed it to another writer. Touches wait
only while writes succeed, and the flusher's own thread never waits.
"""

from __future__ import annotations

import asyncio
import threading
import time

from coalescer.errors import BackpressureError, ClosedError
from coalescer.write.buffer import Buffer, Entry, Matcher

GATE_BACKLOG = 4000  # with more new keys since the flusher's last take, touches wait ...
GATE_WAIT = 0.005  # ... this long at most for its next take (seconds)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Backpressure(Buffer):
    """The buffer's bounds at work: refusals, waits for room, the gate."""

    def __init__(self, match: Matcher, *, max_keys: int, max_items: int | None = None) -> None:
        super().__init__(match, max_keys=max_keys, max_items=max_items)
        self._room = threading.Condition(self._lock)  # notified when keys leave the buffer
        self._room_futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closing = False
        self._took = threading.Condition(threading.Lock())  # notified by a take, if waited on
        self._taken_fresh = 0  # ``fresh`` at the last take, set under ``_took``
        self._flowing = True  # the last write ended well (touches wait for takes only then)
        self.waits = 0  # times a waiting touch found the buffer full
        self.waited_for_take = 0  # touches that waited for the flusher to take a batch
        self.refused_by: str | None = None  # why Redis refuses writes now (see refusals.py)

    def why_unwritten(self) -> str:
        """What a full buffer's BackpressureError says keeps the keys from Redis."""
        return self.refused_by or "is Redis reachable?"

    def _full(self, key: str) -> BackpressureError:
        return BackpressureError(
            f"touch({key!r}) refused: {self._max_keys} keys are already buffered "
            f"and not yet written to Redis ({self.why_unwritten()})")

    def _room_for_new(self, new: int) -> None:
        """BackpressureError when ``new`` keys not buffered yet do not fit (lock held)."""
        if len(self._pending) + self._taken + new > self._max_keys:
            raise BackpressureError(
                f"{new} new keys refused: {len(self._pending)} keys are already buffered "
                f"(the bound is {self._max_keys}) and not yet written to Redis "
                f"({self.why_unwritten()})")

    def _room_for_item(self, key: str, item: str) -> None:
        """BackpressureError when a touch of ``key`` with ``item`` does not fit (lock held)."""
        if key not in self._pending and len(self._pending) + self._taken >= self._max_keys:
            raise BackpressureError(
                f"touch({key!r}, {item!r}) refused: {self._max_keys} keys are already "
                f"buffered and not yet written to Redis ({self.why_unwritten()})")
        if self._item_count >= self._max_items:
            raise self._items_full(f"touch({key!r}, {item!r})")

    def _items_full(self, what: str) -> BackpressureError:
        return BackpressureError(
            f"{what} refused: {self._item_count} items are already buffered (the bound is "
            f"{self._max_items}) and not yet written to Redis ({self.why_unwritten()})")

    def _wait_for_take(self) -> None:
        """Wait (at most ``GATE_WAIT``) until the flusher takes its next batch; see the
        module's "Threads". Never on the flusher's own thread, nor after a failed write."""
        if not self._flowing or threading.get_ident() == self._flusher_thread:
            return
        with self._took:
            if self.fresh - self._taken_fresh <= GATE_BACKLOG:
                return  # taken meanwhile
            self.waited_for_take += 1
            self._took.wait(GATE_WAIT)

    def _after_take(self) -> None:
        """The flusher took what was ready (perhaps nothing: every key held): it had its
        turn, so the touches waiting for it go on and the count of new keys restarts."""
        with self._took:
            self._taken_fresh = self.fresh
            self._took.notify_all()

    def offer(self, items: list[Entry], start: int, spec: str | None = None) -> int:
        """Buffer ``items[start:]`` in order while there is room (each with the time
        ``spec``, None for plain touches); returns the index of the first one left out
        (``len(items)``: all are in). Raises ClosedError once ``close_waits`` was called."""
        with self._lock:
            if self._closing:
                raise ClosedError("touch refused: the coalescer is closing")
            i = self._offer_locked(items, start)
            if spec is not None or self._schedules:
                for key, _, _ in items[start:i]:
                    self._timed_locked(key, spec)
        if i > start:
            self._poke()
        return i

    def _offer_locked(self, items: list[Entry], start: int) -> int:
        pending, room = self._pending, self._max_keys - len(self._pending) - self._taken
        i = start
        while i < len(items):
            key, rule, item = items[i]
            if item is not None:
                if (key not in pending and room <= 0) or self._item_count >= self._max_items:
                    break
                room -= key not in pending
                self._item_locked(key, rule, item)
                i += 1
                continue
            if key not in pending:
                if room <= 0:
                    break
                room -= 1
                pending[key] = rule
                self.fresh += 1
                if self._pending_since is None:
                    self._pending_since = time.monotonic()
            else:
                self.absorbed += 1
            i += 1
        return i

    def wait_room(self, timeout: float | None) -> bool:
        """Block this thread until some room is freed (or ``close_waits``); False when
        ``timeout`` seconds passed first. Never call it on the flusher's event loop."""
        with self._lock:
            if self._closing or self._has_room_locked():
                return True
            self.waits += 1
            return self._room.wait(timeout)

    def room_future(self) -> asyncio.Future[None]:
        """A future of the running loop, done once room is freed (at once if there is
        some now, or once ``close_waits`` is called)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._closing or self._has_room_locked():
                future.set_result(None)
            else:
                self.waits += 1
                self._room_futures.append((loop, future))
        return future

    def _has_room_locked(self) -> bool:
        return (len(self._pending) + self._taken < self._max_keys
                and self._item_count < self._max_items)

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
