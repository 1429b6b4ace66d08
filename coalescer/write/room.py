"""Touches that wait for room in a full buffer, for at most a timeout.

``touch`` refuses a key at once when the buffer is full (BackpressureError): a
request path must never block. A bulk writer would rather wait until the flusher
has written some keys to Redis. ``touch_blocking`` blocks a thread,
``touch_waiting`` suspends a coroutine; both are woken when a write ends (never by
polling) and buffer keys in order as room frees, so a list larger than the buffer
goes in piece by piece. Every key is checked first: a refused key (unknown, or
unstorable) buffers nothing. After ``timeout`` seconds without room for the rest,
BackpressureError says how many keys went in; those stay buffered and are written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import NamedTuple

from coalescer.common.plural import plural
from coalescer.errors import BackpressureError
from coalescer.write.absorber import Absorber
from coalescer.write.buffer import Entry

DEFAULT_TIMEOUT = 30.0  # seconds a waiting touch waits for room, by default


class Wanted(NamedTuple):
    """Touches to buffer: plain ones of ``keys``, (key, item) ones of ``pairs``, all
    with the time ``spec`` (config/schedule.py; None: no time of their own)."""

    keys: Sequence[str]
    pairs: Sequence[tuple[str, str]] = ()
    spec: str | None = None


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, or None, got {timeout!r}")
    return time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _timed_out(absorber: Absorber, what: str, done: int, total: int,
               timeout: float | None) -> BackpressureError:
    head = (f"{what} refused" if total == 1 else
            f"{what}: {done} of {plural(total, 'key')} buffered, the other {total - done} "
            "refused")
    why = absorber.refused_by or "is Redis reachable, or keeping up?"
    return BackpressureError(
        f"{head} after waiting {timeout:g}s for room: {absorber.max_keys} keys are buffered "
        f"and not yet written to Redis ({why})")


def _entries(absorber: Absorber, keys: Sequence[str],
             pairs: Sequence[tuple[str, str]]) -> list[Entry]:
    """Every touch checked (a refused one raises before anything is buffered): the
    plain ones of ``keys``, then the (key, item) ones of ``pairs``."""
    return absorber.rules_of(list(keys)) + absorber.rules_of_items(list(pairs))


def touch_blocking(absorber: Absorber, wanted: Wanted, timeout: float | None,
                   what: str) -> None:
    """Buffer the ``wanted`` touches, blocking this thread while the buffer is full."""
    deadline = _deadline(timeout)
    items, spec = _entries(absorber, wanted.keys, wanted.pairs), wanted.spec
    done = absorber.offer(items, 0, spec)
    while done < len(items):
        left = _left(deadline)
        if left == 0 or not absorber.wait_room(left):
            raise _timed_out(absorber, what, done, len(items), timeout)
        done = absorber.offer(items, done, spec)


async def touch_waiting(absorber: Absorber, wanted: Wanted, timeout: float | None,
                        what: str) -> None:
    """Buffer the ``wanted`` touches, suspending the calling coroutine while the buffer
    is full."""
    deadline = _deadline(timeout)
    items, spec = _entries(absorber, wanted.keys, wanted.pairs), wanted.spec
    done = absorber.offer(items, 0, spec)
    while done < len(items):
        left = _left(deadline)
        room = absorber.room_future()
        try:
            if left == 0 and not room.done():
                raise TimeoutError
            await asyncio.wait_for(room, left)
        except TimeoutError:
            raise _timed_out(absorber, what, done, len(items), timeout) from None
        done = absorber.offer(items, done, spec)
