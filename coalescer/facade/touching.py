"""``Touching``: what a touch does, in every form (one key, many, with items, at a
time, waiting for room in the buffer, from a source), and the checks a caller can run
first (unknown keys, refused items). ``Coalescer`` and, through it, ``SyncCoalescer``
touch only through here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from coalescer.config.priority import Priority, priority_ms, with_priority
from coalescer.config.schedule import At, Delay, schedule_spec
from coalescer.errors import InvalidItemError, UnknownKeyError
from coalescer.facade.core import Core
from coalescer.store.keycheck import check_item, key_problem
from coalescer.write.room import Wanted, touch_blocking, touch_waiting

Pairs = list[tuple[str, str]]


def _spec(keys: list[str], at: At | None, delay: Delay | None, ahead: float,
          keep: bool = False) -> str | None:
    """The wire form of the time of touches of ``keys`` (config/schedule.py), None for
    plain ones; InvalidScheduleError names the first key (and how many more), or the
    time when it lies more than ``ahead`` seconds ahead."""
    if at is None and delay is None:
        return None
    shown = keys[0] if len(keys) == 1 else (
        f"{keys[0]} (and {len(keys) - 1} more)" if keys else "(no key)")
    return schedule_spec(shown, at, delay, ahead=ahead, keep_items=keep)


def one_touch(key: str, item: str | None) -> tuple[list[str], Pairs]:
    """One touch as the keys and (key, item) pairs a wait for room takes."""
    return ([key], []) if item is None else ([], [(key, item)])


class Touching:
    """Every touch of one coalescer (see ``Coalescer.touch`` for what one does)."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def _ready(self, what: str) -> None:
        """ClosedError unless running; QuotaExceededError when the quota is reached."""
        self.core._running(what)
        self.core._check_quota()

    def _wanted(self, keys: list[str], pairs: Pairs, at: At | None,
                delay: Delay | None) -> Wanted:
        ahead = self.core.config.limits.max_schedule_ahead
        return Wanted(keys, pairs, _spec(keys + [k for k, _ in pairs], at, delay, ahead))

    def _with_priority(self, keys: list[str], spec: str | None,
                       priority: Priority | None) -> str | None:
        """``spec`` with ``priority`` for every one of ``keys`` (InvalidPriorityError
        names the first it refuses; UnknownKeyError a key no rule matches)."""
        if priority is None:
            return spec
        ms = 0
        for key in keys:
            ms = priority_ms(key, priority, self.core.config.rule_for(key))
        return with_priority(spec, ms)

    def touch(self, key: str, item: str | None, at: At | None,  # noqa: PLR0913
              delay: Delay | None, keep_items: bool, *,
              priority: Priority | None = None) -> None:
        core = self.core
        if core._state != "running":
            raise core._not_running(f"touch({key!r})")
        core._check_quota()
        if at is not None or delay is not None or priority is not None:
            spec = _spec([key], at, delay, core.config.limits.max_schedule_ahead, keep_items)
            spec = self._with_priority([key], spec, priority)
            core._absorber.touch_scheduled(key, spec or "", item)
        elif item is None:
            core._absorber.touch(key)
        else:
            core._absorber.touch_item(key, item)
        if core._record is not None:
            core._record(key)

    def touch_items(self, pairs: Iterable[tuple[str, str]],  # noqa: PLR0913
                    keys: Iterable[str], at: At | None, delay: Delay | None,
                    keep_items: bool, *, priority: Priority | None = None) -> None:
        self._ready("touch_items()")
        pairs, keys = list(pairs), list(keys)
        touched = [k for k, _ in pairs] + keys
        ahead = self.core.config.limits.max_schedule_ahead
        spec = _spec(touched, at, delay, ahead, keep_items)
        self.core._run.absorber.touch_items(pairs, keys,
                                            self._with_priority(touched, spec, priority))
        self.record_all(touched)

    def touch_many(self, keys: Iterable[str], at: At | None, delay: Delay | None,
                   keep_items: bool, priority: Priority | None = None) -> None:
        self._ready("touch_many()")
        keys = list(keys)
        ahead = self.core.config.limits.max_schedule_ahead
        spec = self._with_priority(keys, _spec(keys, at, delay, ahead, keep_items), priority)
        self.core._run.absorber.touch_many(keys, spec)
        self.record_all(keys)

    async def touch_wait(self, key: str, item: str | None, timeout: float | None,
                         at: At | None, delay: Delay | None) -> None:
        await self.wait_for_room(f"touch_wait({key!r})", *one_touch(key, item), timeout,
                                 at=at, delay=delay)

    async def wait_for_room(self, what: str, keys: Iterable[str],  # noqa: PLR0913
                            pairs: Iterable[tuple[str, str]], timeout: float | None, *,
                            at: At | None, delay: Delay | None) -> None:
        """Touch every key and pair, waiting (on the event loop) while the buffer is full."""
        self._ready(what)
        await self._wait(what, self._wanted(list(keys), list(pairs), at, delay), timeout)

    async def _wait(self, what: str, wanted: Wanted, timeout: float | None) -> None:
        await touch_waiting(self.core._run.absorber, wanted, timeout, what)
        self.record_all(list(wanted.keys) + [k for k, _ in wanted.pairs])

    def block_for_room(self, what: str, keys: Iterable[str],  # noqa: PLR0913
                       pairs: Iterable[tuple[str, str]], timeout: float | None, *,
                       at: At | None, delay: Delay | None) -> None:
        """``wait_for_room`` for a thread that is not running an event loop."""
        self._ready(what)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"{what} would block the event loop running in this "
                               "thread (and the flusher that frees room): await "
                               "touch_wait() or touch_many_wait() instead")
        wanted = self._wanted(list(keys), list(pairs), at, delay)
        touch_blocking(self.core._run.absorber, wanted, timeout, what)
        self.record_all(list(wanted.keys) + [k for k, _ in wanted.pairs])

    def touch_timed(self, touches: list[tuple[str, str | None, str]]) -> None:
        """Touch each (key, item or None, time in its wire form: config/schedule.py),
        all or none: what a source's ``at:``/``delay:`` gives (sources/times.py)."""
        self._ready("touch (from a source)")
        self.core._run.absorber.touch_timed(touches)

    def record_all(self, keys: list[str]) -> None:
        """With tracing on, record the current span's context with each of ``keys``."""
        record = self.core._record
        if record is not None:
            for key in keys:
                record(key)

    def trace_links(self, pairs: list[tuple[str, str]]) -> None:
        """Record each (key, producer's W3C traceparent), for the key's refresh to link
        to (tracing on; a context that does not read is ignored)."""
        traces = self.core._traces
        if traces is not None:
            for key, traceparent in pairs:
                traces.record_remote(key, traceparent)

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        out = []
        for key in keys:
            try:
                self.core.config.rule_for(key)
            except UnknownKeyError:
                out.append(key)
        return out

    def refused_items(self, pairs: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for index, (key, item) in enumerate(pairs):
            problem = self._item_problem(key, item)
            if problem is not None:
                out.append({"index": index, "key": key, "item": item, "error": problem})
        return out

    def _item_problem(self, key: str, item: str) -> str | None:
        """Why (key, item) would be refused for its item or key; None for a good one or
        a key no rule matches (``unknown_keys`` names those)."""
        problem = key_problem(key)
        if problem is not None:
            return f"key cannot be stored: {problem}"
        try:
            rule = self.core.config.rule_for(key)
        except UnknownKeyError:
            return None
        try:
            check_item(key, item, rule.name, rule.items is not None)
        except InvalidItemError as exc:
            return exc.reason
        return None
