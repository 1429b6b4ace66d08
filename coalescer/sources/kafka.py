"""Kafka sources: every message of the source's topics touches the key its value fills in.

Each worker node reads each Kafka source in the source's consumer group (aiokafka),
``batch`` messages at most at a time; a batch is touched, flushed and only then are its
offsets committed, with the node's partitions paused meanwhile. What a message that
cannot become a touch (``kafka_values``), a rebalance, a failed flush and a broker that
is down do: docs/sources.md, "The Kafka source", "Guarantees". What a node last saw
(each partition's lag, its error) is kept in Redis for ``coalescer status``.

``drain()`` reads a Kafka source once (``KafkaLoop.read_now``), up to each partition's
end offset as the drain starts. A worker's drain lets the node's own loop read (it
reads as soon as messages come): it waits until the loop has committed each of the
node's partitions up to that offset (so after their flush). A writer's drain (no
loop runs here) reads every partition of the topics itself, batch by batch as above,
without joining the group (a join costs seconds of rebalancing): from the group's
committed offsets (``start`` where there are none, as for a new group), committing
after each flush as the loop does; while nodes elsewhere are members of the group, it
refuses those commits and the members read the messages once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from coalescer.common.log_once import LogOnce
from coalescer.common.redact import redact
from coalescer.common.retrying import Backoff, keep_running
from coalescer.config.kafka_source import KafkaSource, bootstrap_problem
from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig, source_error
from coalescer.errors import ConfigError, KeyRefusedError, QuotaExceededError
from coalescer.sources.base import (
    LoopSources,
    NodeContext,
    SourceType,
    register,
)
from coalescer.sources.kafka_commit import commit_timeout, flush_timeout, log_refused
from coalescer.sources.kafka_status import REPORT_IDLE, kafka_status
from coalescer.sources.kafka_values import MessageReader, Touches
from coalescer.sources.kafka_watch import StallWatch
from coalescer.store.keys import sources_kafka, sources_rejected

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 10.0  # seconds a batch waits for Redis to hold its touches; then rewound
COMMIT_TIMEOUT = 10.0  # seconds a commit may take (the broker retries inside)
STOP_TIMEOUT = 3.0  # seconds leaving the group may take (a broker down never answers)
PROBE_EVERY = 2.0  # seconds between two looks at an idle source's broker
POLL_MS = 1000  # how long a read waits for messages
DRAIN_POLL_MS = 100  # how long a writer's drain's read waits for messages
CAUGHT_UP_CHECK = 0.25  # seconds between two looks of a worker's drain at its loop, at most
REPORT_EVERY = 1.0  # seconds between two reports of a changing lag, at least
REJECTS_LOGGED = 20  # rejected messages logged one by one a minute; the rest counted


def _kafka() -> Any:
    """aiokafka, imported when a Kafka source starts (the ``kafka`` extra)."""
    import aiokafka  # type: ignore[import-untyped]

    return aiokafka


@contextlib.asynccontextmanager
async def _stopped_if_failed(consumer: Any) -> AsyncIterator[None]:
    """Stop ``consumer`` (quietly) when the block raises; the error goes on."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            await consumer.stop()
        raise


def _refused(touches: Touches, why: str) -> Touches:
    """``touches`` none of which went in (``limits`` refused them): every message
    rejected with ``why``, to be counted and committed as rejected ones are."""
    wheres = [*touches.keys_from, *touches.timed_from, *touches.pairs_from]
    return Touches(rejected=[*touches.rejected, *((*where, why) for where in wheres)])


def _listener(loop: KafkaLoop) -> Any:
    """A ConsumerRebalanceListener that hands the group's rebalance calls to ``loop``."""
    class Rebalance(_kafka().ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            await loop.revoked(revoked)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            await loop.assigned(assigned)

    return Rebalance()


class KafkaLoop:
    """Reads one Kafka source and turns its messages into touches."""

    def __init__(self, source: KafkaSource, context: NodeContext, bootstrap: str) -> None:
        self.source = source
        self._context = context
        self._bootstrap = bootstrap
        self._reader = MessageReader(source, context.config)
        self._rejects = LogOnce(log, lines=REJECTS_LOGGED)  # the lines of rejected messages
        self._redis = context.conn.client
        self._consumer: Any = None
        self._batch_lock = asyncio.Lock()  # a batch and a rebalance never overlap
        self._looping = False  # run() started: a worker's drain waits for the loop
        self._joined = False  # the group gave this consumer its partitions (maybe none)
        self._progress = asyncio.Event()  # a commit, or partitions given: drains look
        self._offsets: Any = None  # a worker's drain's consumer of end offsets (no group)
        self._rewind: dict[Any, int] = {}  # partition -> first offset of the batch in hand
        self._committed: dict[Any, int] = {}  # partition -> offset this node last committed
        self._probed = 0.0
        self._fresh: set[Any] = set()  # partitions given, whose committed offset to read
        self._reported_at = 0.0
        self._reported: Any = None
        self.error: str | None = None
        self.watch = StallWatch(source)  # /healthz's reason when no partition, no reads
        self.unflushed = 0  # messages read and not yet flushed and committed
        self.peak_unflushed = 0
        self.accepted = 0
        self.rejected = 0

    @property
    def what(self) -> str:
        """The topics and broker read, as errors and logs name them."""
        return f"Kafka topics {', '.join(self.source.topics)} at {redact(self._bootstrap)}"

    async def run(self) -> None:
        """The loop: survives a broker or Redis that is down; backs off."""
        self._looping = True
        await keep_running(f"source {self.source.name}: {self.what}", self.step,
                           backoff=Backoff(base=0.1, cap=5.0), logger=log,
                           on_error=self._failed, pause=self._pause)

    def _failed(self, exc: Exception) -> None:
        text = str(exc)
        name = type(exc).__name__
        self.error = redact(text if text.startswith(name) else f"{name}: {text}".strip())
        self._context.metrics.kafka_errors.labels(self.source.name).inc()
        self.watch.restart()
        self._seek_back()

    async def _pause(self, delay: float) -> None:
        with contextlib.suppress(Exception):  # Redis may be what failed
            await asyncio.wait_for(self._report(force=True), 2.0)
        await asyncio.sleep(delay)

    async def step(self) -> int:
        """One read and its handling; returns how many messages it handled."""
        if self._consumer is None:
            await self._connect()
        batch = await self._consumer.getmany(timeout_ms=POLL_MS, max_records=self.source.batch)
        heard = bool(batch)  # the broker answered: messages read and committed
        if batch:
            async with self._batch_lock:
                await self._handle(batch)
        else:
            heard = await self._probe()
            await self._commit_positions()
        if heard and self.error is not None:
            log.info("source %s: Kafka reachable again", self.source.name)
            self.error = None
        await self._learn_committed()
        await self.watch.look(self._redis, sources_kafka(self._context.config.namespace),
                              bool(self._consumer.assignment()), self.lags())
        await self._report()
        return sum(len(messages) for messages in batch.values())

    async def read_now(self) -> int:
        """Every message up to each partition's end offset as it starts, touched,
        flushed and committed: by the running loop (a worker's drain waits for it) or
        read here, batch by batch; how many messages. Raises what the broker or Redis
        raises: a batch not committed is read again."""
        if self._looping:
            return await self._loop_caught_up()
        try:
            if self._consumer is None:
                await self._connect_assigned()
            total = await self._read_to_ends()
            await self._commit_positions()
        except Exception as exc:
            self._failed(exc)
            raise
        return total

    async def _read_to_ends(self) -> int:
        total = 0
        owned = self._consumer.assignment()
        if not owned:
            return 0  # the topics have no partitions (or do not exist)
        ends = await asyncio.wait_for(self._consumer.end_offsets(list(owned)), COMMIT_TIMEOUT)
        while not await self._read_up_to(ends, owned):
            batch = await self._consumer.getmany(timeout_ms=DRAIN_POLL_MS,
                                                 max_records=self.source.batch)
            if batch:
                async with self._batch_lock:
                    await self._handle(batch)
                total += sum(len(messages) for messages in batch.values())
        return total

    async def _loop_caught_up(self) -> int:
        """Wait until the running loop has committed each of this node's partitions up
        to its end offset as the wait starts (nothing to wait for once the group gave
        the node no partition); how many messages that was."""
        ends: dict[Any, int] = {}
        first: dict[Any, int] = {}
        while True:
            self._progress.clear()
            owned = self._consumer.assignment() if self._consumer is not None else set()
            new = [tp for tp in owned if tp not in ends]
            if new:
                ends.update(await self._end_offsets(new))
                first.update({tp: self._committed.get(tp, ends[tp]) for tp in new})
            if (owned or self._joined) and all(self._committed.get(tp, -1) >= ends[tp]
                                               for tp in owned):
                return sum(max(0, ends[tp] - first[tp]) for tp in owned)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), CAUGHT_UP_CHECK)

    async def _read_up_to(self, ends: Mapping[Any, int], owned: Any) -> bool:
        """Whether each partition still this consumer's is read up to its end in ``ends``."""
        for tp in owned:
            if await self._consumer.position(tp) < ends[tp]:
                return False
        return True

    async def _commit_positions(self) -> None:
        """When idle, commit where each partition with no commit yet stands (nothing read
        is unflushed then): its lag is known, and a group starting at ``latest`` keeps
        the messages published from now on even if the node stops before reading one."""
        missing = [tp for tp in self._consumer.assignment() if tp not in self._committed]
        if missing:
            await self._commit({tp: await self._consumer.position(tp) for tp in missing})

    async def _learn_committed(self) -> None:
        """Read the committed offsets of the partitions given since the last step."""
        fresh, self._fresh = self._fresh, set()
        for tp in fresh & self._consumer.assignment():
            offset = await asyncio.wait_for(self._consumer.committed(tp), COMMIT_TIMEOUT)
            if offset is not None:
                self._committed.setdefault(tp, offset)
                self._progress.set()
        if fresh:
            self._reported_at = 0.0

    async def _connect(self) -> None:
        aiokafka = _kafka()
        consumer = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap, group_id=self.source.group,
            client_id=f"coalescer-{self._context.node_id}", enable_auto_commit=False,
            auto_offset_reset=self.source.start, max_partition_fetch_bytes=1 << 20,
            fetch_max_bytes=8 << 20, heartbeat_interval_ms=1000)
        async with _stopped_if_failed(consumer):
            consumer.subscribe(list(self.source.topics), listener=_listener(self))
            await consumer.start()
        self._consumer = consumer
        log.info("source %s: reading topics %s in group %r", self.source.name,
                 ", ".join(self.source.topics), self.source.group)

    async def _end_offsets(self, partitions: list[Any]) -> dict[Any, int]:
        """The end offsets of ``partitions`` now, asked on a connection of their own: the
        loop's consumer would ask only after its pending fetch (up to half a second)."""
        if self._offsets is None:
            consumer = _kafka().AIOKafkaConsumer(
                bootstrap_servers=self._bootstrap, enable_auto_commit=False,
                client_id=f"coalescer-{self._context.node_id}-offsets")
            async with _stopped_if_failed(consumer):
                await consumer.start()
            self._offsets = consumer
        found = await asyncio.wait_for(self._offsets.end_offsets(partitions), COMMIT_TIMEOUT)
        return dict(found)

    async def _connect_assigned(self) -> None:
        """A consumer of every partition of the topics, outside the group's membership
        (for a writer's drain): committed offsets are read, and commits made, in the
        group's name."""
        aiokafka = _kafka()
        consumer = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap, group_id=self.source.group,
            client_id=f"coalescer-{self._context.node_id}", enable_auto_commit=False,
            auto_offset_reset=self.source.start, max_partition_fetch_bytes=1 << 20,
            fetch_max_bytes=8 << 20)
        async with _stopped_if_failed(consumer):
            await consumer.start()
            known = await asyncio.wait_for(consumer.topics(), COMMIT_TIMEOUT)
            consumer.assign([aiokafka.TopicPartition(topic, partition)
                             for topic in self.source.topics if topic in known
                             for partition in sorted(consumer.partitions_for_topic(topic)
                                                     or ())])
        self._consumer = consumer

    async def _probe(self) -> bool:
        """When idle, ask the broker for its metadata now and then (at once after an
        error): raises while it is down; whether it asked."""
        now = time.monotonic()
        if self.error is None and now - self._probed < PROBE_EVERY:
            return False
        self._probed = now
        await asyncio.wait_for(self._consumer.topics(), COMMIT_TIMEOUT)
        return True

    async def _handle(self, batch: Mapping[Any, Sequence[Any]]) -> None:
        """Touch, flush, then commit the batch (rejected messages too)."""
        self._unflushed(sum(len(messages) for messages in batch.values()))
        self._rewind = {tp: messages[0].offset for tp, messages in batch.items() if messages}
        touches = self._reader.touches((m for messages in batch.values() for m in messages),
                                       traced=self._context.trace_links is not None)
        partitions = list(batch)
        self._consumer.pause(*partitions)  # read no further until the batch is flushed
        try:
            touches = await self._touch(touches)
            self._rewind = {}
            await self._commit({tp: messages[-1].offset + 1
                                for tp, messages in batch.items() if messages})
        finally:
            self._resume(partitions)
        self._unflushed(0)
        await self._count(touches)

    def _unflushed(self, count: int) -> None:
        self.unflushed = count
        self._context.metrics.kafka_unflushed.labels(self.source.name).set(count)
        if count > self.peak_unflushed:
            self.peak_unflushed = count
            self._context.metrics.kafka_unflushed_peak.labels(self.source.name).set(count)

    def _resume(self, partitions: list[Any]) -> None:
        owned = self._consumer.assignment()
        self._consumer.resume(*[tp for tp in partitions if tp in owned])

    async def _touch(self, touches: Touches) -> Touches:
        """Touch and flush; returns the touches made (a batch with a key no rule takes
        is screened, its messages rejected, and touched again)."""
        try:
            self._apply(touches)
        except KeyRefusedError:
            touches = self._reader.screen(touches)
            self._apply(touches)
        except QuotaExceededError as exc:  # before any touch went in: all rejected
            touches = _refused(touches, str(exc))
        if touches.traced and self._context.trace_links is not None:
            self._context.trace_links(touches.traced)
        if touches.keys or touches.pairs or touches.timed:
            try:
                await asyncio.wait_for(self._context.flush(), FLUSH_TIMEOUT)
            except TimeoutError:
                raise flush_timeout(self.source.name, FLUSH_TIMEOUT) from None
        return touches

    def _apply(self, touches: Touches) -> None:
        """Buffer the touches, each kind all or none (a kind applied twice after a
        refusal of the next costs nothing: touches are idempotent)."""
        if touches.pairs:
            touch_items = self._context.touch_items
            assert touch_items is not None  # a node with sources always lends it
            touch_items(touches.pairs)
        if touches.timed:
            touch_timed = self._context.touch_timed
            assert touch_timed is not None  # a node with sources always lends it
            touch_timed(touches.timed)
        if touches.keys:
            self._context.touch_many(touches.keys)

    async def _commit(self, offsets: dict[Any, int]) -> None:
        """Commit ``offsets`` of the partitions still this node's; a commit the group
        refuses because they moved on is dropped (their new owner reads them again)."""
        aiokafka = _kafka()
        owned = self._consumer.assignment()
        mine = {tp: offset for tp, offset in offsets.items() if tp in owned}
        if len(mine) < len(offsets):
            log.info("source %s: %d partition(s) moved to another node before their batch "
                     "was committed; it reads those messages again", self.source.name,
                     len(offsets) - len(mine))
        if not mine:
            return
        try:
            await asyncio.wait_for(self._consumer.commit(mine), COMMIT_TIMEOUT)
        except aiokafka.errors.CommitFailedError as exc:
            log_refused(self.source.name, self.source.group, exc, looping=self._looping)
            return
        except TimeoutError:
            raise commit_timeout(self.source.name, self.source.group, COMMIT_TIMEOUT) from None
        self._committed.update(mine)
        self._progress.set()
        log.debug("source %s: committed %d partition(s)", self.source.name, len(mine))

    def _seek_back(self) -> None:
        """After a failed batch, read it again from its first messages."""
        rewind, self._rewind = self._rewind, {}
        self._unflushed(0)
        if self._consumer is None:
            return
        owned = self._consumer.assignment()
        for tp, offset in rewind.items():
            if tp in owned:
                self._consumer.seek(tp, offset)
        self._consumer.resume(*[tp for tp in rewind if tp in owned])

    async def revoked(self, revoked: Any) -> None:
        """The group takes partitions away: wait for the batch in hand to be committed."""
        self._joined = False  # until the rebalance gives this consumer its partitions
        if revoked and self._batch_lock.locked():
            log.info("source %s: the group takes %d partition(s); the batch in hand is "
                     "flushed and committed first", self.source.name, len(revoked))
        async with self._batch_lock:
            with contextlib.suppress(Exception):  # the new owner reports them anyway
                await asyncio.wait_for(self._redis.hdel(
                    sources_kafka(self._context.config.namespace),
                    *[f"{self.source.name}|{tp.topic}|{tp.partition}" for tp in revoked]),
                    2.0)
            for tp in revoked:
                self._committed.pop(tp, None)
                with contextlib.suppress(KeyError):
                    self._context.metrics.kafka_lag.remove(self.source.name, tp.topic,
                                                           str(tp.partition))
        if revoked:
            log.info("source %s: gave up %d partition(s)", self.source.name, len(revoked))

    async def assigned(self, assigned: Any) -> None:
        """The group hands partitions to this node: their committed offsets are read
        after the rebalance (for the lag shown before their first batch)."""
        self._fresh.update(assigned)
        self._joined = True
        self._progress.set()
        if assigned:
            log.info("source %s: was given %d partition(s): %s", self.source.name,
                     len(assigned), ", ".join(f"{tp.topic}/{tp.partition}"
                                              for tp in sorted(assigned)))

    async def _count(self, touches: Touches) -> None:
        counter = self._context.metrics.source_entries
        accepted = len(touches.keys) + len(touches.pairs) + len(touches.timed)
        if accepted:
            self.accepted += accepted
            counter.labels(self.source.name, "accepted").inc(accepted)
        rejected = touches.rejected
        if not rejected:
            return
        self.rejected += len(rejected)
        counter.labels(self.source.name, "rejected").inc(len(rejected))
        for topic, partition, offset, why in rejected:  # REJECTS_LOGGED lines a minute
            self._rejects.warning("rejected", "source %s: message %s/%d@%d rejected "
                                  "(committed, not touched): %s", self.source.name, topic,
                                  partition, offset, why)
        await self._redis.hincrby(sources_rejected(self._context.config.namespace),
                                  self.source.name, len(rejected))

    def lags(self) -> dict[Any, tuple[int, int | None, int | None]]:
        """Each partition of this node: (committed, end offset, lag), None unknown."""
        out: dict[Any, tuple[int, int | None, int | None]] = {}
        if self._consumer is None:
            return out
        for tp in self._consumer.assignment():
            end = self._consumer.highwater(tp)
            committed = self._committed.get(tp)
            if committed is None:
                continue
            out[tp] = (committed, end, None if end is None else max(0, end - committed))
        return out

    async def _report(self, *, force: bool = False) -> None:
        """Keep what this node sees in Redis: at most every REPORT_EVERY while it
        changes, every REPORT_IDLE when not, at once after an error."""
        lags = self.lags()
        error = self.error or self.watch.problem
        shown = (sorted((str(tp), v) for tp, v in lags.items()), error)
        age = time.monotonic() - self._reported_at
        if not force and (age < REPORT_EVERY or (shown == self._reported
                                                 and age < REPORT_IDLE)):
            return
        now_ms = round(time.time() * 1000)
        fields = {f"{self.source.name}|node|{self._context.node_id}":
                  json.dumps({"error": error, "at_ms": now_ms})}
        for tp, (committed, end, lag) in lags.items():
            fields[f"{self.source.name}|{tp.topic}|{tp.partition}"] = json.dumps(
                {"node": self._context.node_id, "committed": committed, "end": end,
                 "lag": lag, "at_ms": now_ms})
            if lag is not None:
                self._context.metrics.kafka_lag.labels(self.source.name, tp.topic,
                                                       str(tp.partition)).set(lag)
        await self._redis.hset(sources_kafka(self._context.config.namespace), mapping=fields)
        self._reported, self._reported_at = shown, time.monotonic()

    async def close(self) -> None:
        """Leave the group (its partitions go to the other nodes) and drop this node's
        report of its error."""
        consumer, self._consumer = self._consumer, None
        offsets, self._offsets = self._offsets, None
        for stopped in (consumer, offsets):
            if stopped is not None:
                await self._stop(stopped)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.hdel(
                sources_kafka(self._context.config.namespace),
                f"{self.source.name}|node|{self._context.node_id}"), 2.0)


    async def _stop(self, consumer: Any) -> None:
        """Stop ``consumer`` within STOP_TIMEOUT, in a task of its own (aiokafka may raise
        CancelledError)."""
        stopping = asyncio.ensure_future(consumer.stop())
        await asyncio.wait([stopping], timeout=STOP_TIMEOUT)
        if stopping.done() and not stopping.cancelled() and stopping.exception():
            log.info("source %s: leaving the group failed: %r", self.source.name,
                     stopping.exception())
        stopping.cancel()


class KafkaSources(LoopSources[KafkaLoop]):
    """Every Kafka source's loop on one worker node."""

    async def stop(self) -> None:
        """Stop reading (what was read and not committed is read again by the group's
        next owner of the partitions), leave the groups: even when the stop is cut short
        by the node's deadline."""
        try:
            await self.cancel_loops()
        finally:
            for loop in self.loops:
                await loop.close()

    def problems(self) -> list[str]:
        """What /healthz reports of these sources: each one that cannot read (its error
        is in ``coalescer status``: /healthz is served without a token)."""
        return [f"Kafka source {loop.source.name!r} cannot read (see coalescer status)"
                if loop.error is not None else f"Kafka source {loop.source.name!r}: "
                f"{loop.watch.problem}" for loop in self.loops
                if loop.error is not None or loop.watch.problem is not None]


def _kafka_sources(sources: Sequence[SourceConfig]) -> list[KafkaSource]:
    return [source for source in sources if isinstance(source, KafkaSource)]


def open_kafka(sources: Sequence[SourceConfig], context: NodeContext) -> KafkaSources:
    """The loops of the Kafka ``sources``, each with a consumer of its own (started by
    its first step, so a broker that is down delays the source, never the node)."""
    return KafkaSources([KafkaLoop(source, context, source.resolved_bootstrap(os.environ))
                         for source in _kafka_sources(sources)])


def check_kafka(source: SourceConfig, index: int, config: Config,
                environ: Mapping[str, str]) -> list[ConfigError]:
    """Why ``source`` cannot run on this node: an environment variable of its bootstrap
    not set, a bootstrap that is no host:port list, or aiokafka not installed."""
    assert isinstance(source, KafkaSource)
    try:
        bootstrap = source.resolved_bootstrap(environ)
    except KeyError as exc:
        return [source_error(source, index, config.source,
                             f"bootstrap uses the environment variable {exc.args[0]}, which "
                             "is not set (or empty)", "bootstrap")]
    problem = bootstrap_problem(bootstrap)
    if problem is not None:
        return [source_error(source, index, config.source, f"bootstrap {problem}",
                             "bootstrap")]
    try:
        _kafka()
    except ImportError:
        return [source_error(source, index, config.source,
                             "reading Kafka needs aiokafka: pip install 'coalescer[kafka]'",
                             "type")]
    return []


register(SourceType(name=KafkaSource.type, open=open_kafka, status=kafka_status,
                    check=check_kafka))
