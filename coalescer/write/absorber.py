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

Items (a rule with ``items:``) ride on a separate path: a key touched with an item
keeps its distinct items in ``_items`` (at most its rule's ``items.max``; past it an
``OVERFLOW`` mark instead) beside its entry in ``pending``, and a taken batch carries
the items of its keys (``Batch.item_sets``). Plain touches never look at them. Buffered
items are bounded too (``max_items``).

A touch with a time of its own (``at``/``delay``, see config/schedule.py) keeps the
time's wire form in ``_schedules`` beside its key (the latest one wins); a plain touch
of the key after it marks it (``+``): the write then applies the schedule and the
plain touch after it, in that order. A batch carries them in ``Batch.schedules``; plain
touches look at them only while some key of the buffer has one.

A full buffer refuses ``touch`` (BackpressureError). Writers that would rather wait
``offer`` keys and wait for room: a thread on a condition, a coroutine on a future,
both woken when a write ends and its keys leave the buffer (``written``, ``discard``),
never by polling; ``write/room.py`` bounds the wait.

Threads: a plain touch of a new key takes no lock while the buffer has more than
``SLACK`` keys of room and no key has a time of its own. It adds the key to
``pending`` in one dict operation, atomic under the GIL, and ``take`` never replaces
that dict: it copies it, then removes the keys it took one by one, so a key added
meanwhile stays for the next batch and one touched again goes with this one (whose
write comes after that touch). Closer to the bound, touches take the lock and the
bound is exact; a touch that found room without the lock can pass it only if its
thread was switched out between the check and the insert while the buffer filled
by ``SLACK`` keys. Sixteen threads touching at once then cost about what one does:
with the lock on every touch, each thread switched out while holding it sent the
others to sleep on it, and the switches cost more than the touches.

The flusher runs on an event loop in a thread of its own (``SyncCoalescer``) or the
application's. Threads that touch without pause hold the GIL in turns of 5 ms
(``sys.getswitchinterval()``), and the loop's thread, back from each wait for Redis,
queues behind all of them: with 16 such threads it ran about once in 80 ms (at times
once in 600 ms), keys piled up unwritten until the buffer was full, and Redis sat idle
meanwhile. Yielding the GIL (``time.sleep(0)``) hands it to any waiting thread, most
often another writer, and each yield cost a thread switch. So once more than
``GATE_BACKLOG`` new keys came in since the flusher last took what was ready, a touch
of a new key waits (at most ``GATE_WAIT``) until it takes again: the touching threads stop
asking for the GIL, and the loop's thread is the one that gets it. Touches wait only
while writes succeed: after a failed write (Redis down or refusing, the keys given
back) none waits until a write succeeds again, so an outage never slows ``touch``;
the full buffer refuses instead. The flusher's own thread never waits (its loop would
be the one to take).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from types import MappingProxyType

from coalescer.config.rules import Rule
from coalescer.config.schedule import then_plain
from coalescer.errors import BackpressureError, ClosedError
from coalescer.store.keycheck import check_item, check_key
from coalescer.store.script_types import OVERFLOW
from coalescer.write.recent_writes import RecentWrites

Matcher = Callable[[str], Rule]  # key -> its Rule; raises UnknownKeyError
Entry = tuple[str, Rule, str | None]  # a checked touch waiting for room: key, rule, item
ItemSets = Mapping[str, Collection[str]]  # key -> its items ("" for an overflow)
NO_ITEMS: ItemSets = MappingProxyType({})
Schedules = Mapping[str, str]  # key -> the wire form of its touch's time
NO_SCHEDULES: Schedules = MappingProxyType({})
ITEMS_PER_KEY = 10  # buffered items allowed per buffered key, on average (max_items)
GATE_BACKLOG = 4000  # with more new keys since the flusher's last take, touches wait ...
GATE_WAIT = 0.005  # ... this long at most for its next take (seconds)
SLACK = 1000  # a plain touch takes no lock while the buffer has more room than this


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Batch(dict[str, Rule]):
    """Keys taken for one write (key -> rule); ``since`` is when the oldest was touched,
    ``taken_at`` when the batch was taken, both on the ``time.monotonic()`` clock;
    ``item_sets`` the items of those of its keys touched with some."""

    since: float
    taken_at: float
    item_sets: ItemSets = NO_ITEMS
    schedules: Schedules = NO_SCHEDULES


def _add_item(bag: set[str], item: str, most: int) -> int:
    """Add ``item`` to a key's buffered items (at most ``most``, then an overflow mark);
    returns how many entries the set grew by."""
    if item in bag:
        return 0
    if len(bag) - (OVERFLOW in bag) < most:
        bag.add(item)
        return 1
    if OVERFLOW in bag:
        return 0
    bag.add(OVERFLOW)
    return 1


def _count(items: ItemSets) -> int:
    return sum(len(its) for its in items.values())


class Absorber:
    """Buffers touched keys; bounded by ``max_keys``."""

    def __init__(self, match: Matcher, *, max_keys: int, max_items: int | None = None) -> None:
        self._match = match
        self._max_keys = max_keys
        self._slack = min(SLACK, max_keys // 2)  # touch() locks this close to the bound
        self._max_items = max_items if max_items is not None else max_keys * ITEMS_PER_KEY
        self._pending: dict[str, Rule] = {}
        self._items: dict[str, set[str]] = {}  # items of pending keys, where some were touched
        self._schedules: dict[str, str] = {}  # times of pending keys touched with one
        self._item_count = 0  # items buffered: in ``_items`` and in batches being written
        self._taken = 0  # keys taken for a write that has not yet succeeded or failed
        self._pending_since: float | None = None  # oldest touch in ``pending``, about
        self._taken_since: Counter[float] = Counter()  # a batch's stamp -> keys unfinished
        self._recent = RecentWrites(max_keys=max_keys)
        self._writing: list[Batch] = []  # batches taken and not yet finished (see finished)
        self._lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None
        self._flusher_thread: int | None = None  # the thread of the flusher's event loop
        self._room = threading.Condition(self._lock)  # notified when keys leave the buffer
        self._room_futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closing = False
        self._took = threading.Condition(threading.Lock())  # notified by a take, if waited on
        self._taken_fresh = 0  # ``fresh`` at the last take, set under ``_took``
        self._flowing = True  # the last write ended well (touches wait for takes only then)
        self.idle = True
        self.fresh = 0  # touches that buffered a key not buffered yet
        self.absorbed = 0  # touches of a key already buffered
        self.waits = 0  # times a waiting touch found the buffer full
        self.waited_for_take = 0  # touches that waited for the flusher to take a batch
        self.refused_by: str | None = None  # why Redis refuses writes now (see refusals.py)

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` tells the flusher there is something to send now; called on the
        flusher's thread."""
        self._wake = wake
        self._flusher_thread = threading.get_ident()

    def why_unwritten(self) -> str:
        """What a full buffer's BackpressureError says keeps the keys from Redis."""
        return self.refused_by or "is Redis reachable?"

    @property
    def max_keys(self) -> int:
        return self._max_keys

    @property
    def touches(self) -> int:
        """Touches accepted (counted apart, so that an absorbed touch adds to one count)."""
        return self.fresh + self.absorbed

    def __len__(self) -> int:
        """Keys accepted and not yet in Redis, the ones being written included."""
        return len(self._pending) + self._taken

    def touch(self, key: str) -> None:
        """Buffer one touch of ``key``. Raises UnknownKeyError, BackpressureError.

        Takes no lock while the buffer is far from full, no key has a time of its own
        and the flusher keeps up; waits at most ``GATE_WAIT`` for it otherwise (see the
        module's "Threads")."""
        pending = self._pending
        if key in pending and (not self._schedules or self._plain_after(key)):
            self.absorbed += 1
            return
        check_key(key)  # a key Redis cannot store is refused here: not counted
        rule = self._match(key)  # so is an unknown key
        if self._schedules or len(pending) + self._taken >= self._max_keys - self._slack:
            self._touch_locked(key, rule)
        else:
            self.fresh += 1
            pending[key] = rule  # one atomic step: take() removes keys, never the dict
            if self._pending_since is None:
                self._pending_since = time.monotonic()
        self._poke()
        if self.fresh - self._taken_fresh > GATE_BACKLOG:
            self._wait_for_take()

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

    def _touch_locked(self, key: str, rule: Rule) -> None:
        """``touch`` near a full buffer (or with times buffered): the exact bound."""
        with self._lock:
            if len(self._pending) + self._taken >= self._max_keys and key not in self._pending:
                raise self._full(key)
            if self._schedules and key in self._pending:
                self._timed_locked(key, None)  # taken and touched again meanwhile
                self.absorbed += 1
                return
            self.fresh += 1
            self._pending[key] = rule
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    def _full(self, key: str) -> BackpressureError:
        return BackpressureError(
            f"touch({key!r}) refused: {self._max_keys} keys are already buffered "
            f"and not yet written to Redis ({self.why_unwritten()})")

    def _plain_after(self, key: str) -> bool:
        """Mark a plain touch of buffered ``key`` after its scheduled one; False when the
        key is no longer buffered (a write took it meanwhile)."""
        with self._lock:
            if key not in self._pending:
                return False
            self._timed_locked(key, None)
            return True

    def _timed_locked(self, key: str, spec: str | None) -> None:
        """A touch of buffered ``key`` with time ``spec`` (None: a plain touch), lock held."""
        if spec is not None:
            self._schedules[key] = spec  # the latest schedule wins
        elif self._schedules:
            old = self._schedules.get(key)
            if old is not None:
                self._schedules[key] = then_plain(old)

    def touch_scheduled(self, key: str, spec: str, item: str | None = None) -> None:
        """Buffer one touch of ``key`` with its time ``spec`` (config/schedule.py) and
        ``item``; the errors of ``touch`` and ``touch_item``."""
        if item is None:
            self.touch_many([key], spec)
        else:
            self.touch_items([(key, item)], (), spec)

    def touch_timed(self, touches: list[tuple[str, str | None, str]]) -> None:
        """Buffer every (key, item or None, time) touch, each with its own time, or none:
        a refused one (KeyRefusedError) or BackpressureError applies nothing."""
        checked = [(key, self._rule(key) if item is None else self._item_rule(key, item),
                    item, spec) for key, item, spec in touches]
        with self._lock:
            new_keys = {key for key, _, _, _ in checked if key not in self._pending}
            if len(self._pending) + self._taken + len(new_keys) > self._max_keys:
                raise BackpressureError(
                    f"{len(new_keys)} new keys refused: {len(self._pending)} keys are "
                    f"already buffered (the bound is {self._max_keys}) and not yet written "
                    f"to Redis ({self.why_unwritten()})")
            with_items = sum(item is not None for _, _, item, _ in checked)
            if with_items and self._item_count + with_items > self._max_items:
                raise self._items_full(f"{with_items} items")
            for key, rule, item, spec in checked:
                if item is None:
                    self._plain_locked({key: rule})
                else:
                    self._item_locked(key, rule, item)
                self._timed_locked(key, spec)
        if checked:
            self._poke()

    def touch_item(self, key: str, item: str) -> None:
        """Buffer one touch of ``key`` carrying ``item``. Raises UnknownKeyError,
        InvalidKeyError, InvalidItemError (also for a key whose rule takes no items),
        BackpressureError."""
        rule = self._item_rule(key, item)
        with self._lock:
            self._room_for_item(key, item)
            self._item_locked(key, rule, item)
            self._timed_locked(key, None)
        self._poke()

    def touch_items(self, pairs: Iterable[tuple[str, str]], keys: Iterable[str] = (),
                    spec: str | None = None) -> None:
        """Buffer every (key, item) touch, and every plain touch of ``keys``, or none: a
        refused one (KeyRefusedError) or BackpressureError applies nothing. ``spec``:
        the time of every one of them (config/schedule.py), None for plain touches."""
        checked = [(key, self._item_rule(key, item), item) for key, item in pairs]
        plain = {key: self._rule(key) for key in keys}
        with self._lock:
            new_keys = {key for key, _, _ in checked if key not in self._pending}
            new_keys.update(key for key in plain if key not in self._pending)
            if len(self._pending) + self._taken + len(new_keys) > self._max_keys:
                raise BackpressureError(
                    f"{len(new_keys)} new keys refused: {len(self._pending)} keys are "
                    f"already buffered (the bound is {self._max_keys}) and not yet written "
                    f"to Redis ({self.why_unwritten()})")
            if self._item_count + len(checked) > self._max_items:
                raise self._items_full(f"{len(checked)} items")
            for key, rule, item in checked:
                self._item_locked(key, rule, item)
                self._timed_locked(key, spec)
            if plain:
                self._plain_locked(plain)
                for key in plain:
                    self._timed_locked(key, spec)
        if checked or plain:
            self._poke()

    def _plain_locked(self, rules: dict[str, Rule]) -> None:
        """Buffer checked plain touches (lock held, room checked)."""
        new = [key for key in rules if key not in self._pending]
        self._pending.update(rules)
        if new and self._pending_since is None:
            self._pending_since = time.monotonic()
        self.fresh += len(new)
        self.absorbed += len(rules) - len(new)

    def _item_rule(self, key: str, item: str) -> Rule:
        rule = self._pending.get(key) or self._rule(key)
        check_item(key, item, rule.name, rule.items is not None)
        return rule

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

    def _item_locked(self, key: str, rule: Rule, item: str) -> None:
        """Buffer a checked touch of ``key`` with ``item`` (lock held, room checked)."""
        assert rule.items is not None
        if key in self._pending:
            self.absorbed += 1
        else:
            self.fresh += 1
            self._pending[key] = rule
            if self._pending_since is None:
                self._pending_since = time.monotonic()
        bag = self._items.get(key)
        if bag is None:
            bag = self._items[key] = set()
        self._item_count += _add_item(bag, item, rule.items.max)

    def _poke(self) -> None:
        # Wake the flusher even for a held key: it then sleeps to the key's release
        # time, instead of its idle check, so the touch is written within ``absorb``.
        if self.idle:
            self.idle = False
            self._wake()

    # -- waiting for room (see write/room.py) --

    def rules_of(self, keys: list[str]) -> list[Entry]:
        """Each key with its rule; a refused key raises (KeyRefusedError) before any
        key is buffered."""
        return [(key, self._rule(key), None) for key in keys]

    def rules_of_items(self, pairs: list[tuple[str, str]]) -> list[Entry]:
        """Each (key, item) touch with the key's rule; a refused one raises
        (KeyRefusedError, InvalidItemError) before anything is buffered."""
        return [(key, self._item_rule(key, item), item) for key, item in pairs]

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

    def touch_many(self, keys: list[str], spec: str | None = None) -> None:
        """Buffer every key or none: a refused key (KeyRefusedError) or BackpressureError
        applies nothing. ``spec``: the time of every touch (config/schedule.py)."""
        rules = {key: self._rule(key) for key in keys}
        with self._lock:
            new = [key for key in rules if key not in self._pending]
            if len(self._pending) + self._taken + len(new) > self._max_keys:
                raise BackpressureError(
                    f"{len(new)} new keys refused: {len(self._pending)} keys are already "
                    f"buffered (the bound is {self._max_keys}) and not yet written to Redis "
                    f"({self.why_unwritten()})")
            self._pending.update(rules)
            if spec is not None or self._schedules:
                for key in rules:
                    self._timed_locked(key, spec)
            if new and self._pending_since is None:
                self._pending_since = time.monotonic()
            fresh = bool(new)  # held keys too (see touch)
            self.fresh += len(new)
            self.absorbed += len(keys) - len(new)
        if fresh and self.idle:
            self.idle = False
            self._wake()

    def drop(self, keys: Iterable[str]) -> set[str]:
        """Forget the buffered touches of ``keys`` that no write has taken yet (a cancel
        drops them); returns the keys that had some."""
        with self._lock:
            gone = {key for key in keys if self._pending.pop(key, None) is not None}
            for key in gone:
                self._item_count -= len(self._items.pop(key, ()))
                self._schedules.pop(key, None)
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
            snapshot = dict(self._pending)  # touch() may add keys meanwhile (lock-free)
            held_since = None
            if everything:
                ready.update(snapshot)
            else:
                held_since = self._split_ready(snapshot, ready)
            self._taken += len(ready)  # first: meanwhile touch() counts them twice, not 0
            self._remove(ready, held_since, ready.taken_at)
            if self._items:  # only where items were touched: plain touches skip this
                self._take_items(ready)
            if self._schedules:  # likewise for touches with a time
                self._take_schedules(ready)
            if ready:
                self._taken_since[ready.since] += len(ready)
                self._writing.append(ready)
        self._after_take()
        return ready

    def _take_items(self, ready: Batch) -> None:
        """Move the items of the keys in ``ready`` along with them (lock held)."""
        if not self._pending:
            ready.item_sets, self._items = self._items, {}
            return
        ready.item_sets = {key: self._items.pop(key) for key in list(self._items) if key in ready}

    def _take_schedules(self, ready: Batch) -> None:
        """Move the times of the keys in ``ready`` along with them (lock held)."""
        if not self._pending:
            ready.schedules, self._schedules = self._schedules, {}
            return
        ready.schedules = {key: self._schedules.pop(key) for key in list(self._schedules)
                           if key in ready}

    def finished(self, batch: Batch) -> None:
        """The write of ``batch`` is over (each key written, given back or discarded):
        its keys are no longer held for being in flight. Idempotent."""
        self._writing = [b for b in self._writing if b is not batch]

    def _remove(self, ready: Batch, held_since: float | None, now: float) -> None:
        """Remove the keys of ``ready`` from ``pending``, key by key (lock held): a key
        that touch() adds meanwhile stays, and one it touches again goes with ``ready``,
        which is written after that touch. ``held_since``: the stamp of the held keys."""
        pending = self._pending
        for key in ready:
            del pending[key]
        if held_since is not None:
            self._pending_since = held_since
        else:  # what is left was added during the take: touched no earlier than it
            self._pending_since = now if pending else None

    def _split_ready(self, pending: dict[str, Rule], ready: Batch) -> float | None:
        """Copy the keys of ``pending`` that are not held into ``ready``; the held keys'
        stamp (None when none is held)."""
        holds = self._holds(pending)
        if not holds:
            ready.update(pending)
            return None
        for key, rule in pending.items():
            if key not in holds:
                ready[key] = rule
        since = min(holds.values())
        if self._pending_since is not None:
            since = max(since, self._pending_since)
        return since

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

    def written(self, batch: Mapping[str, Rule], since: float | None = None,
                items: ItemSets = NO_ITEMS) -> None:
        """Remember keys as written: they are recent for their absorb interval.

        ``since`` is the stamp of the batch they were taken in (default ``batch.since``);
        ``items`` the items written with them.
        """
        with self._lock:
            self._finish(batch, since)
            self._item_count -= _count(items)
            self._freed_locked()
        self._flowing = True
        # ``recent`` is only used from the event loop's thread (take, written,
        # next_ready_in), so filling it needs no lock: touch() is never kept waiting.
        self._recent.add(batch)

    def give_back(self, batch: Mapping[str, Rule], since: float | None = None,
                  items: ItemSets = NO_ITEMS, schedules: Schedules = NO_SCHEDULES) -> None:
        """Return unwritten keys (and their ``items`` and times) to the buffer; nothing
        accepted is lost."""
        self._flowing = False  # touches no longer wait for takes (see _wait_for_take)
        with self._lock:
            if schedules:
                self._give_back_schedules(schedules)
            for key, rule in batch.items():
                self._pending.setdefault(key, rule)
            self._finish(batch, since)  # after: meanwhile touch() counts them twice, not 0
            for key, its in items.items():
                self._give_back_items(key, batch[key], its)
            stamp = since if since is not None else getattr(batch, "since", None)
            if batch and stamp is not None:
                old = self._pending_since
                self._pending_since = stamp if old is None else min(old, stamp)

    def _give_back_schedules(self, schedules: Schedules) -> None:
        """Unwritten times go back behind what was touched since (lock held): a newer
        time wins, a plain touch since follows the old one."""
        for key, spec in schedules.items():
            if key in self._schedules:
                continue
            self._schedules[key] = then_plain(spec) if key in self._pending else spec

    def _give_back_items(self, key: str, rule: Rule, items: Collection[str]) -> None:
        """Merge a key's unwritten items into what was touched since (lock held)."""
        bag = self._items.get(key)
        if bag is None:
            self._items[key] = set(items)
            return
        self._item_count -= len(items) + len(bag)
        most = rule.items.max if rule.items is not None else len(items)
        merged = set(bag)
        bag.clear()
        for item in (*items, *merged):  # the older ones first
            _add_item(bag, item, most)
        self._item_count += len(bag)

    def discard(self, batch: Mapping[str, Rule], since: float | None = None,
                items: ItemSets = NO_ITEMS) -> None:
        """Forget keys that can never be written (the flusher dropped them), with their
        ``items``."""
        with self._lock:
            self._finish(batch, since)
            self._item_count -= _count(items)
            self._freed_locked()

    def unwritten_keys(self) -> list[str]:
        """The keys accepted and not yet in Redis: buffered, or in a write not yet
        finished (whose outcome is not known)."""
        with self._lock:
            keys = set(self._pending)
            for batch in self._writing:
                keys.update(batch)
        return sorted(keys)

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
