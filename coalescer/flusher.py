"""The flusher: writes the absorber's batches to Redis, one Lua call per shard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from .absorber import Absorber
from .backoff import Backoff
from .keys import KeySpace
from .metrics import Metrics
from .scripts import Scripts, UpsertGroup

log = logging.getLogger(__name__)

MAX_KEYS_PER_CALL = 2000  # keeps each upsert script short (a few ms of Redis time)
IDLE_CHECK = 1.0


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Flusher:
    """Group-commits buffered touches; ``flush()`` waits until Redis holds them."""

    def __init__(self, absorber: Absorber, scripts: Scripts, keyspace: KeySpace,
                 metrics: Metrics) -> None:
        self._absorber = absorber
        self._scripts = scripts
        self._keyspace = keyspace
        self._metrics = metrics
        self._event = asyncio.Event()
        self._writes: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        absorber.set_waker(self._wake)

    def _wake(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._event.set()
        else:
            self._loop.call_soon_threadsafe(self._event.set)

    async def run(self) -> None:
        """The background loop: survives Redis errors, backs off, loses nothing."""
        backoff = Backoff()
        while True:
            self._event.clear()
            self._absorber.idle = True
            batch = self._absorber.take()
            if not batch:
                await self._sleep()
                continue
            self._absorber.idle = False
            try:
                await self._write(batch)
                backoff.reset()
            except Exception as exc:  # Redis down, or a bug: the loop goes on (logged once)
                self._metrics.redis_errors.labels("flusher").inc()
                backoff.log(log, "flusher: %d keys not written yet, will retry: %r",
                            len(batch), exc)
                await asyncio.sleep(backoff.next())

    async def _sleep(self) -> None:
        wait = self._absorber.next_ready_in()
        timeout = IDLE_CHECK if wait is None else min(wait, IDLE_CHECK)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)

    async def flush(self) -> None:
        """Return once Redis holds every touch buffered before this call."""
        earlier = list(self._writes)
        batch = self._absorber.take(everything=True)
        if batch:
            await self._write(batch)
        if earlier:
            await asyncio.gather(*earlier)

    async def _write(self, batch: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._send(batch))
        self._writes.add(task)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._writes.discard(task)
            else:
                task.add_done_callback(self._writes.discard)

    async def _send(self, batch: dict[str, Any]) -> None:
        try:
            calls = [self._scripts.upsert(self._keyspace.shard(shard), groups)
                     for shard, groups in self._groups(batch)]
            await asyncio.gather(*calls)
        except BaseException:
            self._absorber.give_back(batch)
            raise
        self._absorber.written(batch)
        self._record(len(batch))

    def _record(self, n: int) -> None:
        m, a = self._metrics, self._absorber
        m.flushes.inc()
        m.flush_keys.observe(n)
        m.buffered.set(len(a))

    def _groups(self, batch: dict[str, Any]) -> list[tuple[int, list[UpsertGroup]]]:
        rules: dict[str, Any] = {}
        by_shard: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        shard_of = self._keyspace.shard_of
        for key, rule in batch.items():
            name = rule.name  # group by name: hashing the frozen Rule per key is slow
            rules[name] = rule
            by_shard[shard_of(key)][name].append(key)
        out = []
        for shard, keys_by_rule in by_shard.items():
            for chunk in self._split(rules, keys_by_rule):
                out.append((shard, chunk))
        return out

    @staticmethod
    def _split(rules: dict[str, Any],
               keys_by_rule: dict[str, list[str]]) -> Iterable[list[UpsertGroup]]:
        """One shard's keys as calls of at most MAX_KEYS_PER_CALL keys each."""
        call: list[UpsertGroup] = []
        size = 0
        for name, keys in keys_by_rule.items():
            rule = rules[name]
            for part in _chunks(keys, MAX_KEYS_PER_CALL):
                if size + len(part) > MAX_KEYS_PER_CALL and call:
                    yield call
                    call, size = [], 0
                call.append(UpsertGroup(name, _ms(rule.window), _ms(rule.max_wait), part))
                size += len(part)
        if call:
            yield call
