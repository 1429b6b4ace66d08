"""The flusher: writes the absorber's batches to Redis, one Lua call per shard, up to
``MAX_IN_FLIGHT`` at once; what a failed write keeps, retries or drops is
docs/concepts.md's "Flusher" (the kinds of failure: failures.py; an episode of refused
writes: refusals.py). Items touched with keys travel with their keys, in the same
upsert call (the touch and its items are one atomic step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict, deque
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, NamedTuple

from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.common.retrying import keep_running
from coalescer.config.rules import Rule
from coalescer.errors import LayoutMovedError, shown_key
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.layout import Layouts, carry
from coalescer.store.script_types import UpsertGroup, UpsertResult
from coalescer.store.scripts import Scripts
from coalescer.tracing.bounds import GRACE_MS, KEEP
from coalescer.write.absorber import Absorber
from coalescer.write.buffer import NO_ITEMS, NO_SCHEDULES, Batch, ItemSets, Schedules
from coalescer.write.failures import (
    KEY,
    REASON_REDIS,
    REFUSED,
    DroppedKey,
    classify,
    drop_reason,
    write_error,
)
from coalescer.write.refusals import Refusals
from coalescer.write.routing import Routed, mark_held, part, route, route_asked

if TYPE_CHECKING:
    from coalescer.tracing.touches import TouchTraces

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # writes of the background loop in flight at once
# Each upsert call holds Redis for about 1-2 ms at most (2-3 us a key, the same per key
# as in calls of 2,000): a bulk import's writes never keep another tenant's claim or
# touch waiting longer than that behind each of them.
MAX_KEYS_PER_CALL = 500
MAX_ITEMS_PER_CALL = 5_000  # keys and items per upsert call, when keys carry items
IDLE_CHECK = 1.0
DROPPED_SHOWN = 20  # the last dropped keys kept for /healthz
FLUSH_ROUNDS = 3  # flush() writes keys given back by a failed earlier write this often
MAX_REROUTES = 3  # a write refused for an old layout is routed again this often at most
SETTLE_TIMEOUT = 5.0  # seconds close() waits for the writes in flight to end
FORGET_ROUNDS = 5  # a cancel waits for this many writes of its keys at most (see forget)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _group(rule: Rule, keys: list[str], items: ItemSets,
           times: Schedules = NO_SCHEDULES) -> UpsertGroup:
    mine = {key: items[key] for key in keys if key in items}
    timed = {key: times[key] for key in keys if key in times} if times else None
    return UpsertGroup(rule.name, _ms(rule.window), _ms(rule.max_wait), keys,
                       mine or None, rule.items.max if rule.items is not None else 0,
                       schedules=timed or None, leading=rule.leading)


def _split_with_items(rules: dict[str, Rule], keys_by_rule: dict[str, list[str]],
                      items: ItemSets,
                      times: Schedules = NO_SCHEDULES) -> Iterable[list[UpsertGroup]]:
    """One shard's keys, their items and times as calls of at most MAX_KEYS_PER_CALL
    keys and MAX_ITEMS_PER_CALL keys and items each (a key's items are never split)."""
    call: list[UpsertGroup] = []
    part: list[str] = []
    keys_in, weight = 0, 0
    for name, keys in keys_by_rule.items():
        for key in keys:
            cost = 1 + len(items.get(key, ()))
            if (keys_in >= MAX_KEYS_PER_CALL or weight + cost > MAX_ITEMS_PER_CALL) and keys_in:
                if part:
                    call.append(_group(rules[name], part, items, times))
                yield call
                call, part, keys_in, weight = [], [], 0, 0
            part.append(key)
            keys_in, weight = keys_in + 1, weight + cost
        if part:
            call.append(_group(rules[name], part, items, times))
            part = []
    if call:
        yield call


def _halves(groups: list[UpsertGroup], n: int) -> tuple[list[UpsertGroup], list[UpsertGroup]]:
    """The first ``n`` keys of ``groups``, and the rest, still grouped by rule."""
    first: list[UpsertGroup] = []
    second: list[UpsertGroup] = []
    for g in groups:
        cut = max(0, min(len(g.keys), n))
        if cut:
            first.append(part(g, g.keys[:cut]))
        if cut < len(g.keys):
            second.append(part(g, g.keys[cut:]))
        n -= cut
    return first, second


def _items_of(groups: list[UpsertGroup]) -> ItemSets:
    """The items the groups carry, by key."""
    if not any(g.items for g in groups):
        return NO_ITEMS
    return {key: items for g in groups if g.items for key, items in g.items.items()}


def _times_of(groups: list[UpsertGroup]) -> Schedules:
    """The times the groups carry, by key."""
    if not any(g.schedules for g in groups):
        return NO_SCHEDULES
    return {key: t for g in groups if g.schedules for key, t in g.schedules.items()}


def _keys_of(groups: list[UpsertGroup], batch: Batch) -> dict[str, Rule]:
    """The groups' keys with their rules (a group's keys share one rule)."""
    out: dict[str, Rule] = {}
    for g in groups:
        if g.keys:
            out.update(dict.fromkeys(g.keys, batch[g.keys[0]]))
    return out


class Hop(NamedTuple):
    """How a call is written: the layout its shards come from, how often it was routed
    again for a newer one, and the tokens granted by the old shard that asked its keys
    away (a reshard; 0 otherwise)."""

    keyspace: KeySpace
    reroutes: int = 0
    min_seq: int = 0


class Unwritten(Exception):
    """A write of the background loop failed; its keys stay buffered for the next."""

    def __init__(self, keys: int, cause: BaseException) -> None:
        super().__init__(keys, cause)
        self.keys = keys
        self.cause = cause

    def __repr__(self) -> str:
        # an error reply is logged once per episode (refusals.py), with its text
        cause = "Redis refuses writes" if classify(self.cause) == REFUSED else repr(self.cause)
        return f"{plural(self.keys, 'key')} not written yet: {cause}"


class Flusher:
    """Group-commits buffered touches; ``flush()`` waits until Redis holds them."""

    def __init__(self, absorber: Absorber, scripts: Scripts, layouts: Layouts,
                 metrics: Metrics) -> None:
        self._absorber = absorber
        self._scripts = scripts
        self._layouts = layouts
        self._metrics = metrics
        self._event = asyncio.Event()
        self._writes: dict[asyncio.Task[None], Batch] = {}  # every write not yet finished
        self._running: dict[asyncio.Task[None], int] = {}  # the loop's writes -> their keys
        self._loop = asyncio.get_running_loop()
        self.dropped: deque[DroppedKey] = deque(maxlen=DROPPED_SHOWN)
        self.refusals = Refusals(metrics)
        self.last_failure: str | None = None  # why the background loop's last write failed
        self.traces: TouchTraces | None = None  # touches' span contexts, with tracing on
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
        await keep_running("flusher", self._write_until_one_ends, logger=log,
                           on_error=self._failed)

    def _failed(self, exc: Exception) -> None:
        self._metrics.redis_errors.labels("flusher").inc()
        self.last_failure = str(write_error(exc.cause if isinstance(exc, Unwritten) else exc))

    async def _write_until_one_ends(self) -> None:
        """Start writes of batches as they come, until one of them ends."""
        while not await self._reap():
            self._event.clear()
            self._absorber.idle = True
            batch = self._absorber.take()
            if not batch:
                await self._sleep()
                continue
            self._absorber.idle = False
            self._running[self._start(batch)] = len(batch)

    async def _reap(self) -> bool:
        """Wait for room for another write; True if a write ended well, and raises
        ``Unwritten`` if one failed (its keys are buffered again)."""
        if len(self._running) >= MAX_IN_FLIGHT:
            await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
        written = False
        failed: Unwritten | None = None
        for task in [t for t in self._running if t.done()]:
            n = self._running.pop(task)
            exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
            if exc is None:
                written = True
            else:
                failed = Unwritten(n, exc)
        if failed is not None:
            raise failed
        return written

    def _start(self, batch: Batch) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._send(batch))
        self._writes[task] = batch
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._writes.pop(task, None)
        if not task.cancelled():  # its error is retrieved (the flush that waited for it
            task.exception()  # may be gone, cut short by its caller's timeout)
        self._event.set()  # keys held while it was in flight may be ready; room for a write

    async def _sleep(self) -> None:
        wait = self._absorber.next_ready_in()
        timeout = IDLE_CHECK if wait is None else min(wait, IDLE_CHECK)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)

    async def flush(self) -> None:
        """Return once Redis holds every touch buffered before this call. A write
        already in flight that fails gives its keys back; they are written again here
        (a few rounds at most), so a write that failed before Redis came back does not
        fail this call. Raises RedisUnreachableError or RedisRefusesWritesError (the
        keys stay buffered, and the background loop goes on writing them)."""
        try:
            await self._flush_rounds()
        except Exception as exc:
            raise write_error(exc) from exc

    async def _flush_rounds(self) -> None:
        earlier = list(self._writes)
        for _ in range(FLUSH_ROUNDS):
            batch = self._absorber.take(everything=True)
            if batch:
                await self._write(batch)
            results = await asyncio.gather(*earlier, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                return
            earlier = list(self._writes)  # the keys given back may be on their way again
        raise failed[0]

    async def settle(self, timeout: float = SETTLE_TIMEOUT) -> None:
        """Wait (up to ``timeout``) for the writes in flight to end, each written or
        given back (closing: what is still buffered then was not written)."""
        writes = list(self._writes)
        if writes:
            await asyncio.wait(writes, timeout=timeout)

    async def forget(self, keys: Collection[str]) -> set[str]:
        """Drop the buffered touches of ``keys`` (a cancel); returns the keys that had
        some. Returns once no write in flight carries one of them: every touch of them
        made before this call is then in Redis or dropped. A write that failed gives its
        keys back to the buffer, where they are dropped in turn; a touch made while this
        runs may go either way."""
        dropped: set[str] = set()
        for _ in range(FORGET_ROUNDS):
            dropped |= self._absorber.drop(keys)
            writes = [task for task, batch in self._writes.items()
                      if not task.done() and not batch.keys().isdisjoint(keys)]
            if not writes:
                break
            await asyncio.wait(writes)
        if self.traces is not None:
            self.traces.forget(keys)
        return dropped

    async def _write(self, batch: Batch) -> None:
        await asyncio.shield(self._start(batch))

    async def _send(self, batch: Batch) -> None:
        try:
            await self._send_groups(batch)
        finally:
            self._absorber.finished(batch)

    async def _send_groups(self, batch: Batch) -> None:
        try:
            await self._layouts.recheck()
        except Exception as exc:  # the write meets the same error, and says so
            log.info("reading the shard layout again failed: %r", exc)
        keyspace = self._layouts.keyspace
        try:
            parts = self._groups(batch, keyspace)
        except BaseException:
            self._absorber.give_back(batch, schedules=batch.schedules)
            raise
        await self._deliver_all(Hop(keyspace), parts, batch)
        self._record(len(batch))

    async def _deliver_all(self, hop: Hop, parts: Routed, batch: Batch) -> None:
        calls = [self._deliver(hop, shard, groups, batch) for shard, groups in parts]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result  # transient: those keys were given back

    async def _reroute(self, exc: LayoutMovedError, hop: Hop,
                       groups: list[UpsertGroup], batch: Batch) -> None:
        """A shard follows a newer layout than ``keyspace``: read it, write again."""
        try:
            if hop.reroutes >= MAX_REROUTES:
                raise exc
            await self._layouts.refresh(newer_than=hop.keyspace.gen)
        except BaseException:
            self._give_back(groups, batch)
            raise
        keyspace = self._layouts.keyspace
        await self._deliver_all(Hop(keyspace, hop.reroutes + 1), route(keyspace, groups), batch)

    async def _deliver(self, hop: Hop, shard: int, groups: list[UpsertGroup],
                       batch: Batch) -> None:
        """Write one call's keys; on a permanent error, split it to find the bad keys."""
        keyspace = hop.keyspace
        try:
            result = await self._scripts.upsert_keys(keyspace.shard(shard), groups,
                                                     keyspace.gen, hop.min_seq)
        except LayoutMovedError as exc:
            await self._reroute(exc, hop, groups, batch)
            return
        except BaseException as exc:
            if classify(exc) != KEY:
                self._not_taken(exc)
                self._give_back(groups, batch)
                raise
            await self._bisect(hop, shard, groups, batch, exc)
            return
        self._taken()
        keys, items = _keys_of(groups, batch), _items_of(groups)
        if result.asked:
            for key in result.asked:
                keys.pop(key, None)
            items = {k: its for k, its in items.items() if k in keys} if items else items
        self._written(result.failed, keys, items, batch)
        await self._write_traces(keyspace.shard(shard), keys)
        if result.asked:  # their old shard no longer holds them: to their new shard
            asked = route_asked(keyspace, groups, set(result.asked))
            if result.transit:
                await self._carry(keyspace, result, asked, batch)
            await self._deliver_all(hop._replace(min_seq=result.seq), asked, batch)

    async def _write_traces(self, shard: ShardKeys, keys: Iterable[str]) -> None:
        """Keep the span contexts of the touches of ``keys`` (just written) beside them,
        where Redis holds their state; lost if that fails (a touch never waits for its
        trace), or if a claim took the key meanwhile (its next refresh links to them).
        Nothing with tracing off."""
        if self.traces is None:
            return
        values = self.traces.take(keys)
        try:
            await self._scripts.traces_put(shard, values, KEEP, GRACE_MS)
        except Exception as exc:
            log.debug("keeping the trace contexts of %d keys failed: %r", len(values), exc)

    def _not_taken(self, exc: BaseException) -> None:
        if classify(exc) == REFUSED:
            self.refusals.refused(exc)
            self._absorber.refused_by = self.refusals.reason

    def _taken(self) -> None:
        if self._absorber.refused_by is not None:
            self.refusals.taken()
            self._absorber.refused_by = None

    async def _carry(self, keyspace: KeySpace, result: UpsertResult, asked: Routed,
                     batch: Batch) -> None:
        """Put the asked keys still in transit (their mover has not put them: it died,
        or is slow) into their new shards before touching them there, so that no claim
        there misses what they held in their old shard."""
        try:
            await carry(self._scripts, keyspace, result.seq, result.transit)
        except BaseException:
            self._give_back([g for _, gs in asked for g in gs], batch)
            raise

    def _give_back(self, groups: list[UpsertGroup], batch: Batch) -> None:
        """The groups' keys (and items) go back to the buffer: their write failed."""
        self._absorber.give_back(_keys_of(groups, batch), batch.since, _items_of(groups),
                                 _times_of(groups))

    def _written(self, failed: dict[str, str], keys: dict[str, Rule], items: ItemSets,
                 batch: Batch) -> None:
        """Account for a call's keys: the ``failed`` ones dropped, the rest written."""
        if failed:
            if self.traces is not None:
                self.traces.forget(failed)
            bad = {key: keys.pop(key) for key in failed if key in keys}
            for key, error in failed.items():
                self._drop(key, REASON_REDIS, error)
            self._absorber.discard(bad, batch.since, {k: items[k] for k in bad if k in items})
            items = {k: its for k, its in items.items() if k in keys}
        self._absorber.written(keys, batch.since, items)

    async def _bisect(self, hop: Hop, shard: int, groups: list[UpsertGroup],
                      batch: Batch, exc: BaseException) -> None:
        total = sum(len(g.keys) for g in groups)
        if total == 1:
            key = groups[0].keys[0]
            self._drop(key, drop_reason(exc), repr(exc))
            if self.traces is not None:
                self.traces.forget([key])
            self._absorber.discard({key: batch[key]}, batch.since, _items_of(groups))
            return
        first, second = _halves(groups, total // 2)
        try:
            await self._deliver(hop, shard, first, batch)
        except BaseException:
            self._give_back(second, batch)
            raise
        await self._deliver(hop, shard, second, batch)

    def _drop(self, key: str, reason: str, error: str) -> None:
        log.error("flusher: dropped key %s, Redis cannot store it (%s): %s",
                  shown_key(key), reason, error)
        self._metrics.dropped_keys.labels(reason).inc()
        self.dropped.append(DroppedKey.now(key, reason, error))

    def _record(self, n: int) -> None:
        m, a = self._metrics, self._absorber
        m.flushes.inc()
        m.flush_keys.observe(n)
        m.buffered.set(len(a))

    def _groups(self, batch: dict[str, Rule], keyspace: KeySpace) -> Routed:
        rules: dict[str, Rule] = {}
        by_shard = self._by_shard(batch, rules, keyspace)
        out = []
        items = batch.item_sets if isinstance(batch, Batch) else NO_ITEMS
        times = batch.schedules if isinstance(batch, Batch) else NO_SCHEDULES
        for shard, keys_by_rule in by_shard.items():
            split = (self._split(rules, keys_by_rule) if not items and not times
                     else _split_with_items(rules, keys_by_rule, items, times))
            for chunk in split:
                out.append((shard, mark_held(keyspace, shard, chunk)))
        return out

    @staticmethod
    def _by_shard(batch: dict[str, Rule], rules: dict[str, Rule],
                  keyspace: KeySpace) -> dict[int, dict[str, list[str]]]:
        """The batch's keys by shard (a key's old one while a reshard runs), then by
        rule name; fills ``rules`` (name -> rule)."""
        if keyspace.span == 1 and len(set(map(id, batch.values()))) == 1:
            rule = next(iter(batch.values()))  # one shard, one rule: no per-key step
            rules[rule.name] = rule
            return {0: {rule.name: list(batch)}}
        by_shard: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        # one call per key on the hot path: source_of only while a reshard runs
        shard_of = keyspace.source_of if keyspace.resharding else keyspace.shard_of
        for key, rule in batch.items():
            name = rule.name  # group by name: hashing the frozen Rule per key is slow
            rules[name] = rule
            by_shard[shard_of(key)][name].append(key)
        return by_shard

    @staticmethod
    def _split(rules: dict[str, Rule],
               keys_by_rule: dict[str, list[str]]) -> Iterable[list[UpsertGroup]]:
        """One shard's keys as calls of at most MAX_KEYS_PER_CALL keys each."""
        call: list[UpsertGroup] = []
        size = 0
        for name, keys in keys_by_rule.items():
            rule = rules[name]
            for chunk in _chunks(keys, MAX_KEYS_PER_CALL):
                if size + len(chunk) > MAX_KEYS_PER_CALL and call:
                    yield call
                    call, size = [], 0
                call.append(UpsertGroup(name, _ms(rule.window), _ms(rule.max_wait), chunk,
                                        leading=rule.leading))
                size += len(chunk)
        if call:
            yield call
