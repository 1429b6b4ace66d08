"""The buffer of touched keys the absorber keeps between ``touch()`` and Redis: the
keys with their rules (``pending``), and beside them the items and times of the keys
touched with some, with the steps (lock held) that add a touch to them.

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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType

from coalescer.config.priority import merged
from coalescer.config.rules import Rule
from coalescer.config.schedule import then_plain
from coalescer.store.script_types import OVERFLOW

Matcher = Callable[[str], Rule]  # key -> its Rule; raises UnknownKeyError
Entry = tuple[str, Rule, str | None]  # a checked touch waiting for room: key, rule, item
ItemSets = Mapping[str, Collection[str]]  # key -> its items ("" for an overflow)
NO_ITEMS: ItemSets = MappingProxyType({})
Schedules = Mapping[str, str]  # key -> the wire form of its touch's time
NO_SCHEDULES: Schedules = MappingProxyType({})
ITEMS_PER_KEY = 10  # buffered items allowed per buffered key, on average (max_items)
SLACK = 1000  # a plain touch takes no lock while the buffer has more room than this


class Batch(dict[str, Rule]):
    """Keys taken for one write (key -> rule); ``since`` is when the oldest was touched,
    ``taken_at`` when the batch was taken, both on the ``time.monotonic()`` clock;
    ``item_sets`` the items of those of its keys touched with some."""

    since: float
    taken_at: float
    item_sets: ItemSets = NO_ITEMS
    schedules: Schedules = NO_SCHEDULES


def add_item(bag: set[str], item: str, most: int) -> int:
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


def count_items(items: ItemSets) -> int:
    """How many items ``items`` hold, over all keys."""
    return sum(len(its) for its in items.values())


class Buffer:
    """The buffered keys, items and times; bounded by ``max_keys`` and ``max_items``."""

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
        self._lock = threading.Lock()
        self._wake: Callable[[], None] = lambda: None
        self._flusher_thread: int | None = None  # the thread of the flusher's event loop
        self.idle = True
        self.fresh = 0  # touches that buffered a key not buffered yet
        self.absorbed = 0  # touches of a key already buffered

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake`` tells the flusher there is something to send now; called on the
        flusher's thread."""
        self._wake = wake
        self._flusher_thread = threading.get_ident()

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

    def _poke(self) -> None:
        # Wake the flusher even for a held key: it then sleeps to the key's release
        # time, instead of its idle check, so the touch is written within ``absorb``.
        if self.idle:
            self.idle = False
            self._wake()

    def _timed_locked(self, key: str, spec: str | None) -> None:
        """A touch of buffered ``key`` with time ``spec`` (None: a plain touch), lock held."""
        if spec is not None:  # the latest schedule wins, the largest priority
            self._schedules[key] = merged(self._schedules.get(key), spec)
        elif self._schedules:
            old = self._schedules.get(key)
            if old is not None:
                self._schedules[key] = then_plain(old)

    def _plain_locked(self, rules: dict[str, Rule]) -> None:
        """Buffer checked plain touches (lock held, room checked)."""
        new = [key for key in rules if key not in self._pending]
        self._pending.update(rules)
        if new and self._pending_since is None:
            self._pending_since = time.monotonic()
        self.fresh += len(new)
        self.absorbed += len(rules) - len(new)

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
        self._item_count += add_item(bag, item, rule.items.max)
