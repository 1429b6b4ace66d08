"""The in-process absorber between ``touch()`` and Redis: the touches.

A touched key waits in ``pending`` until the flusher writes it; more touches of it are
*absorbed*, never dropped, and a key written lately is *held* (``batches.py``), so a hot
key costs at most one Redis write per absorb interval (docs/concepts.md, "Absorber").

A key is checked once, on the touch that brings it into ``pending`` (the same
place its rule is matched): a key Redis cannot store is refused there. The buffer
itself, its items and times: ``buffer.py``; what a full one refuses, waiting for room
and for the flusher's turn: ``backpressure.py``; the batches the flusher takes:
``batches.py``.

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
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from coalescer.config.rules import Rule
from coalescer.store.keycheck import check_item, check_key
from coalescer.write.backpressure import GATE_BACKLOG
from coalescer.write.batches import Batches
from coalescer.write.buffer import Entry


class Absorber(Batches):
    """Buffers touched keys; bounded by ``max_keys``."""

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

    def _plain_after(self, key: str) -> bool:
        """Mark a plain touch of buffered ``key`` after its scheduled one; False when the
        key is no longer buffered (a write took it meanwhile)."""
        with self._lock:
            if key not in self._pending:
                return False
            self._timed_locked(key, None)
            return True

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
            self._room_for_new(len(new_keys))
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
            self._room_for_new(len(new_keys))
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

    def touch_many(self, keys: list[str], spec: str | None = None) -> None:
        """Buffer every key or none: a refused key (KeyRefusedError) or BackpressureError
        applies nothing. ``spec``: the time of every touch (config/schedule.py)."""
        rules = {key: self._rule(key) for key in keys}
        with self._lock:
            new = [key for key in rules if key not in self._pending]
            self._room_for_new(len(new))
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

    def rules_of(self, keys: list[str]) -> list[Entry]:
        """Each key with its rule; a refused key raises (KeyRefusedError) before any
        key is buffered."""
        return [(key, self._rule(key), None) for key in keys]

    def rules_of_items(self, pairs: list[tuple[str, str]]) -> list[Entry]:
        """Each (key, item) touch with the key's rule; a refused one raises
        (KeyRefusedError, InvalidItemError) before anything is buffered."""
        return [(key, self._item_rule(key, item), item) for key, item in pairs]

    def _rule(self, key: str) -> Rule:
        check_key(key)
        return self._match(key)

    def _item_rule(self, key: str, item: str) -> Rule:
        rule = self._pending.get(key) or self._rule(key)
        check_item(key, item, rule.name, rule.items is not None)
        return rule
