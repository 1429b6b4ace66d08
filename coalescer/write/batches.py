"""The flusher's side of the buffer: the batches it takes, and how their writes end
(written, given back, discarded).

A key written to Redis is remembered in ``recent`` (recent_writes.py: cachetools TTL
caches, one per absorb interval, of the keys written in each slice of it) for about
the rule's ``absorb`` interval; a key touched again while it is recent is *held* until
then, so a hot key costs at most one Redis write per absorb interval. A key touched
again while a write of it is still in flight is held too, until that write ends (and
then for its absorb interval): the flusher keeps a few writes in flight at once, and a
touch that came after a batch was taken is written by a later one.

The age of the oldest unwritten touch is tracked per batch: ``pending`` has the time it
last went from empty to non-empty, each taken batch the stamp it left with.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Mapping

from coalescer.config.priority import with_older
from coalescer.config.rules import Rule
from coalescer.config.schedule import then_plain
from coalescer.write.backpressure import Backpressure
from coalescer.write.buffer import (
    NO_ITEMS,
    NO_SCHEDULES,
    Batch,
    ItemSets,
    Matcher,
    Schedules,
    add_item,
    count_items,
)
from coalescer.write.recent_writes import RecentWrites


class Batches(Backpressure):
    """Taking batches for the flusher and finishing them."""

    def __init__(self, match: Matcher, *, max_keys: int, max_items: int | None = None) -> None:
        super().__init__(match, max_keys=max_keys, max_items=max_items)
        self._taken_since: Counter[float] = Counter()  # a batch's stamp -> keys unfinished
        self._recent = RecentWrites(max_keys=max_keys)
        self._writing: list[Batch] = []  # batches taken and not yet finished (see finished)

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
            self._item_count -= count_items(items)
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
                self._schedules[key] = with_older(self._schedules[key], spec)
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
            add_item(bag, item, most)
        self._item_count += len(bag)

    def discard(self, batch: Mapping[str, Rule], since: float | None = None,
                items: ItemSets = NO_ITEMS) -> None:
        """Forget keys that can never be written (the flusher dropped them), with their
        ``items``."""
        with self._lock:
            self._finish(batch, since)
            self._item_count -= count_items(items)
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
