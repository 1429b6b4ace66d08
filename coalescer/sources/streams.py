"""Stream sources: every entry of a Redis Stream touches the key its fields fill in.

Each worker node reads each source's stream in the source's consumer group, as the
consumer named by its node id; a batch is touched, flushed and only then acknowledged,
and an entry that cannot become a touch is acknowledged too and counted as rejected
(what is rejected, idle entries claimed, a lost stream or group made again:
docs/sources.md, "Guarantees"). Entries are read as bytes, on a client of the sources'
own: a field of any bytes is rejected rather than failing the read, and a blocked read
never holds one of the connections the scripts share.

``drain()`` reads a stream once (``SourceLoop.read_now``), as the same consumer: the
entries it was handed and has not acknowledged, then new entries up to the stream's
last id when it starts, each batch touched, flushed and acknowledged as above. A
running loop's batch is never handled at the same time (they share a lock), nor twice:
entries the drain handled are dropped from the batch the loop read meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from coalescer.common.log_once import LogOnce
from coalescer.common.metrics import Metrics
from coalescer.common.retrying import Backoff, keep_running
from coalescer.common.traceparent import read_traceparent
from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig, StreamSource
from coalescer.errors import QuotaExceededError, UnknownKeyError, shown_key
from coalescer.sources.base import (
    Flush,
    LoopSources,
    NodeContext,
    SourceType,
    TouchItems,
    TouchMany,
    TraceLinks,
    register,
)
from coalescer.sources.stream_old_group import warn_old_group
from coalescer.sources.times import Field, Timed, TouchTimed, time_of
from coalescer.store.connection import Connection, bytes_client
from coalescer.store.keycheck import MAX_ITEM_BYTES, MAX_KEY_BYTES, item_problem, key_problem
from coalescer.store.keys import sources_rejected

log = logging.getLogger(__name__)

BATCH = 500  # entries read (or claimed) at a time
BLOCK_MAX = 10.0  # seconds a read blocks at most when the stream is idle
REJECTS_LOGGED = 20  # rejected entries logged one by one a minute; the rest counted

Entry = tuple[bytes, dict[bytes, bytes] | None]  # id, fields (None: no longer in the stream)
Accepted = tuple[bytes, str, str | None, dict[bytes, bytes] | None]  # id, key, item, fields
TRACEPARENT = b"traceparent"  # an entry's field with its producer's W3C trace context


def block_seconds(claim_lease: float) -> float:
    """How long an idle read blocks: twice ``claim_lease``, from 1 s up to BLOCK_MAX.

    Pending entries of a dead consumer are looked for once per read at most, so
    they are claimed within about ``claim_lease`` plus this after they went idle.
    """
    return min(BLOCK_MAX, max(1.0, 2 * claim_lease))


def _raw(reply: Any, **_options: Any) -> Any:
    return reply


def _entries(items: Iterable[Any] | None) -> list[Entry]:
    out: list[Entry] = []
    for item in items or ():
        if item is None:  # a claimed entry deleted from the stream (Redis 6.2)
            continue
        entry_id, flat = item[0], item[1]
        fields = None if flat is None else dict(zip(flat[::2], flat[1::2], strict=True))
        out.append((entry_id, fields))
    return out


def _read_reply(reply: Any) -> list[Entry]:
    """The entries of an XREADGROUP reply on one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    return [entry for _, items in streams for entry in _entries(items)]


def _field_problem(raw: bytes) -> str | None:
    """Why a field's bytes cannot fill a template, or None. The size is checked first,
    so an oversized field is never decoded; a ``:`` would let one field fill more than
    one segment of a key (and move it into another rule's pattern)."""
    if len(raw) > MAX_KEY_BYTES:
        return f"is {len(raw)} bytes long, over the limit of {MAX_KEY_BYTES} for a key"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    if ":" in text:
        return (f"holds ':' (at index {text.index(':')}): a field fills at most one "
                "segment of a key")
    return None


def _lookup(fields: dict[bytes, bytes] | None) -> Field:
    """An entry's fields by name, as text (None: missing, or not UTF-8)."""
    def field(name: str) -> str | None:
        raw = (fields or {}).get(name.encode("utf-8", "surrogatepass"))
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return field


def _item_field_problem(raw: bytes) -> str | None:
    """Why a field's bytes cannot fill an item template, or None (':' is fine in one)."""
    if len(raw) > MAX_ITEM_BYTES:
        return f"is {len(raw)} bytes long, over the limit of {MAX_ITEM_BYTES} for an item"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    return None


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    """An entry id (``ms-seq``) as numbers, to compare."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _group_gone(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, ResponseError) and ("NOGROUP" in text or "no longer exists" in text)


class SourceLoop:
    """Reads one source's stream and turns its entries into touches."""

    def __init__(self, source: StreamSource, client: Any, *, config: Config, node_id: str,
                 touch_many: TouchMany, flush: Flush, metrics: Metrics,
                 touch_items: TouchItems | None = None,
                 touch_timed: TouchTimed | None = None,
                 trace_links: TraceLinks | None = None) -> None:
        self.source = source
        self._touch_timed = touch_timed
        self._trace_links = trace_links
        self._client = client
        self._config = config
        self._consumer = node_id
        self._touch_many = touch_many
        self._touch_items = touch_items
        self._item_fields = None if source.item is None else [
            (name, name.encode("utf-8", "surrogatepass")) for name in source.item.fields]
        self._flush = flush
        self._rejected_key = sources_rejected(config.namespace)
        self._fields = [(name, name.encode("utf-8", "surrogatepass"))
                        for name in source.key.fields]
        self._claim_idle_ms = max(1, round(config.claim_lease * 1000))
        self._block_ms = round(block_seconds(config.claim_lease) * 1000)
        self._next_claim = 0.0
        self._claim_from = "0-0"
        self._group_ready = False
        self._recreating = False  # the group was ready once: create it again from 0
        self._own_first = True  # re-read this consumer's own pending entries first
        self._metrics = metrics.source_entries
        self._lock = asyncio.Lock()  # one batch handled at a time: the loop's or a drain's
        self._rejects = LogOnce(log, lines=REJECTS_LOGGED)  # the lines of rejected entries
        self._poisons = LogOnce(log)  # entries whose reading raised: a line a minute a kind
        self._drained: set[bytes] = set()  # pending entries a drain handled (and acked)

    @property
    def what(self) -> str:
        """The stream and group read, as errors and logs name them."""
        return f"stream {self.source.stream!r}, group {self.source.group!r}"

    async def run(self) -> None:
        """The loop: survives Redis errors and a lost stream or group; backs off."""
        await keep_running(f"source {self.source.name}: reading stream {self.source.stream!r}",
                           self.step, backoff=Backoff(base=0.05, cap=5.0), logger=log,
                           on_error=self._failed)

    def _failed(self, exc: Exception) -> None:
        self._own_first = True  # re-read what this consumer was handed before the error
        if _group_gone(exc):
            self._group_ready = False

    async def step(self) -> int:
        """One read (or claim) and its handling; returns how many entries it handled."""
        if not self._group_ready:
            await self._create_group()
        entries = await self._claim() if time.monotonic() >= self._next_claim else []
        if not entries:
            entries = await self._read()
        async with self._lock:
            drained, self._drained = self._drained, set()
            entries = [entry for entry in entries if entry[0] not in drained]
            if entries:
                await self._handle(entries)
        return len(entries)

    async def read_now(self) -> int:
        """Handle, batch by batch, the entries this consumer holds unacknowledged, then
        the new ones up to the stream's last id as it starts; how many entries."""
        async with self._lock:
            try:
                if not self._group_ready:
                    await self._create_group()
                newest = await self._client.xrevrange(self.source.stream, count=1)
                total = await self._read_all("0")
                if newest:
                    total += await self._read_all(">", _stream_id(newest[0][0]))
            except Exception as exc:
                self._failed(exc)
                raise
            return total

    async def _read_all(self, start: str, last: tuple[int, int] | None = None) -> int:
        """Read from ``start`` ("0": this consumer's pending entries, ">": new ones, up
        to ``last``) without blocking until none is left, handling each batch."""
        s = self.source
        total = 0
        while True:
            entries = _read_reply(await self._client.xreadgroup(
                s.group, self._consumer, {s.stream: start}, count=BATCH))
            if not entries:
                return total
            if start == "0":  # the running loop may hold them: it skips them then
                self._drained.update(entry_id for entry_id, _ in entries)
            await self._handle(entries)
            total += len(entries)
            if last is not None and _stream_id(entries[-1][0]) >= last:
                return total

    async def _create_group(self) -> None:
        """Create the group (and the stream) if missing: at the configured start the
        first time, from the stream's start when it went missing since."""
        start = self.source.start_id if not self._recreating else "0"
        try:
            await self._client.xgroup_create(self.source.stream, self.source.group, id=start,
                                             mkstream=True)
            log.info("source %s: created group %r on stream %r from %s", self.source.name,
                     self.source.group, self.source.stream,
                     "new entries" if start == "$" else "the stream's start")
            if not self._recreating:
                await warn_old_group(self._client, self.source, self._config.namespace)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True
        self._recreating = True

    async def _claim(self) -> list[Entry]:
        """Claim entries idle longer than claim_lease in anyone's hands (dead consumers')."""
        reply = await self._client.xautoclaim(
            self.source.stream, self.source.group, self._consumer, self._claim_idle_ms,
            start_id=self._claim_from, count=BATCH)
        next_from = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        self._claim_from = next_from
        if next_from in ("0-0", "0"):
            self._next_claim = time.monotonic() + self._config.claim_lease
        entries = _entries(reply[1])
        if entries:
            log.info("source %s: claimed %d entries idle over %gs (from %s to %s)",
                     self.source.name, len(entries), self._config.claim_lease,
                     entries[0][0].decode(), entries[-1][0].decode())
        return entries

    async def _read(self) -> list[Entry]:
        s = self.source
        if self._own_first:
            reply = await self._client.xreadgroup(s.group, self._consumer, {s.stream: "0"},
                                                  count=BATCH)
            entries = _read_reply(reply)
            if entries:
                return entries
            self._own_first = False
        reply = await self._client.xreadgroup(s.group, self._consumer, {s.stream: ">"},
                                              count=BATCH, block=self._block_ms)
        return _read_reply(reply)

    async def _handle(self, entries: list[Entry]) -> None:
        """Touch the keys, flush, then acknowledge every entry (rejected ones too)."""
        accepted, rejected = self._touches(entries)
        timed = self._with_times(accepted, rejected)
        timed_accepted: list[Accepted] = []
        if self.source.at or self.source.delay:
            accepted, timed_accepted = [], accepted  # every touch went in ``timed``
        keys = [key for _, key, item, _ in accepted if item is None]
        pairs = [(key, item) for _, key, item, _ in accepted if item is not None]
        try:
            self._apply(timed, keys, pairs)
        except QuotaExceededError as exc:  # nothing of the batch went in: all rejected
            refused = {entry_id for entry_id, _ in rejected}
            rejected += [(entry_id, str(exc)) for entry_id, *_ in accepted or timed_accepted
                         if entry_id not in refused]
            keys, pairs, timed, accepted, timed_accepted = [], [], [], [], []
        self._link_traces(accepted or timed_accepted)
        if keys or pairs or timed:
            await self._flush()
        await self._client.xack(self.source.stream, self.source.group,
                                *[entry_id for entry_id, _ in entries])
        if rejected:
            await self._client.hincrby(self._rejected_key, self.source.name, len(rejected))
            self._log_rejected(rejected)
            self._metrics.labels(self.source.name, "rejected").inc(len(rejected))
        if keys or pairs or timed:
            self._metrics.labels(self.source.name, "accepted").inc(
                len(keys) + len(pairs) + len(timed))

    def _apply(self, timed: list[Timed], keys: list[str],
               pairs: list[tuple[str, str]]) -> None:
        """Buffer the batch's touches; QuotaExceededError (limits) before any goes in."""
        if timed:
            assert self._touch_timed is not None
            self._touch_timed(timed)
        if keys:
            self._touch_many(keys)
        if pairs:
            assert self._touch_items is not None
            self._touch_items(pairs)

    def _link_traces(self, accepted: list[Accepted]) -> None:
        """With tracing on: the producer's trace context of each entry that carries one
        (a ``traceparent`` field), for the refresh of its key to link to."""
        if self._trace_links is None:
            return
        found = [(key, read_traceparent(fields[TRACEPARENT]))
                 for _, key, _, fields in accepted if fields and TRACEPARENT in fields]
        pairs = [(key, text) for key, text in found if text is not None]  # None: too long
        if pairs:
            self._trace_links(pairs)

    def _touches(self, entries: list[Entry]) -> tuple[list[Accepted],
                                                      list[tuple[bytes, str]]]:
        """The accepted entries (id, key, item or None, fields) and the rejected ones
        (id, why)."""
        accepted: list[Accepted] = []
        rejected: list[tuple[bytes, str]] = []
        for entry_id, fields in entries:
            item: str | None = None
            try:
                key, why = self.key_of(fields)
                if key is not None and self._item_fields is not None:
                    item, why = self.item_of(fields, key)
                    key = key if item is not None else None
            except Exception as exc:  # a poison entry: rejected, never read again
                key, why = None, self._poison(exc, entry_id)
            if key is None:
                rejected.append((entry_id, why))
            else:
                accepted.append((entry_id, key, item, fields))
        return accepted, rejected

    def _with_times(self, accepted: list[Accepted],
                    rejected: list[tuple[bytes, str]]) -> list[Timed]:
        """With ``at:``/``delay:``: every accepted touch with its time (an entry whose
        time cannot be made is added to ``rejected``); without: nothing."""
        if self.source.at is None and self.source.delay is None:
            return []
        timed: list[Timed] = []
        for entry_id, key, item, fields in accepted:
            try:
                spec, why = time_of(self.source, key, _lookup(fields),
                                    self._config.limits.max_schedule_ahead)
            except Exception as exc:  # a poison entry: rejected, never read again
                spec, why = None, self._poison(exc, entry_id)
            if spec is None:
                rejected.append((entry_id, why))
            else:
                timed.append((key, item, spec))
        return timed

    def _poison(self, exc: Exception, entry_id: bytes) -> str:
        """Why an entry whose reading raised ``exc`` is rejected; logged once a minute
        per kind of error (the entry is acknowledged and counted like any rejected one)."""
        text = str(exc)[:200]
        self._poisons.warning(type(exc).__name__,
                              "source %s: entry %s of stream %r raised %s while being read: "
                              "%s", self.source.name, entry_id.decode(), self.source.stream,
                              type(exc).__name__, text)
        return f"it could not be read ({type(exc).__name__}: {text})"

    def item_of(self, fields: dict[bytes, bytes] | None, key: str) -> tuple[str | None, str]:
        """The item an entry's touch of ``key`` carries, or None and why it is rejected."""
        assert self.source.item is not None and self._item_fields is not None
        values: dict[str, str] = {}
        for name, raw_name in self._item_fields:
            raw = (fields or {}).get(raw_name)
            if raw is None:
                return None, f"it has no field {name!r} (for its item)"
            problem = _item_field_problem(raw)
            if problem is not None:
                return None, f"field {name!r} {problem}"
            values[name] = raw.decode("utf-8")
        item = self.source.item.fill(values)
        problem = item_problem(item)
        if problem is None and self._config.rule_for(key).items is None:
            problem = f"the rule of key {shown_key(key)} takes no items"
        if problem is not None:
            return None, f"item {shown_key(item)} cannot be touched: {problem}"
        return item, ""

    def key_of(self, fields: dict[bytes, bytes] | None) -> tuple[str | None, str]:
        """The key an entry touches, or None and why it is rejected."""
        if fields is None:
            return None, "the entry is no longer in the stream (trimmed or deleted)"
        values: dict[str, str] = {}
        for name, raw_name in self._fields:
            raw = fields.get(raw_name)
            if raw is None:
                return None, f"it has no field {name!r}"
            problem = _field_problem(raw)
            if problem is not None:
                return None, f"field {name!r} {problem}"
            values[name] = raw.decode("utf-8")
        key = self.source.key.fill(values)
        problem = key_problem(key)
        if problem is not None:
            return None, f"key {shown_key(key)} cannot be stored: {problem}"
        try:
            self._config.rule_for(key)
        except UnknownKeyError:
            return None, f"no rule matches key {shown_key(key)}"
        return key, ""

    def _log_rejected(self, rejected: list[tuple[bytes, str]]) -> None:
        for entry_id, why in rejected:  # REJECTS_LOGGED lines a minute, the rest counted
            self._rejects.warning("rejected", "source %s: entry %s of stream %r rejected "
                                  "(acknowledged, not touched): %s", self.source.name,
                                  entry_id.decode(), self.source.stream, why)


class Sources(LoopSources[SourceLoop]):
    """Every stream source's loop on one worker node, on a bytes client of their own."""

    def __init__(self, config: Config, client: Any, *, node_id: str, touch_many: TouchMany,
                 flush: Flush, metrics: Metrics,
                 sources: Sequence[StreamSource] | None = None,
                 touch_items: TouchItems | None = None,
                 touch_timed: TouchTimed | None = None,
                 trace_links: TraceLinks | None = None,
                 conn: Connection | None = None) -> None:
        client.set_response_callback("XREADGROUP", _raw)
        client.set_response_callback("XAUTOCLAIM", _raw)
        self._client = client
        self._conn = conn  # whose list of pools holds the client's (a drain's: dropped)
        streams = _streams(config.sources) if sources is None else sources
        super().__init__([SourceLoop(source, client, config=config, node_id=node_id,
                                     touch_many=touch_many, flush=flush, metrics=metrics,
                                     touch_items=touch_items, touch_timed=touch_timed,
                                     trace_links=trace_links)
                          for source in streams])

    async def stop(self) -> None:
        """Stop reading (entries read and not yet acknowledged stay pending), close: the
        client even when the stop is cut short by the node's deadline."""
        try:
            await self.cancel_loops()
        finally:
            await self._client.aclose()
        pool = getattr(self._client, "connection_pool", None)
        if self._conn is not None and pool in self._conn.more_pools:
            self._conn.more_pools.remove(pool)  # opened and closed again by each drain


def _streams(sources: Sequence[SourceConfig]) -> list[StreamSource]:
    return [source for source in sources if isinstance(source, StreamSource)]


def open_streams(sources: Sequence[SourceConfig], context: NodeContext) -> Sources:
    """The loops of the stream ``sources`` on a bytes client of their own, one
    connection each (a read blocks) and one to acknowledge with."""
    streams = _streams(sources)
    client = bytes_client(context.conn, connections=len(streams) + 1,
                          read_timeout=BLOCK_MAX + 5.0)
    return Sources(context.config, client, node_id=context.node_id,
                   touch_many=context.touch_many, flush=context.flush,
                   metrics=context.metrics, sources=streams, touch_items=context.touch_items,
                   touch_timed=context.touch_timed, trace_links=context.trace_links,
                   conn=context.conn)


async def stream_status(redis: Any, source: SourceConfig,
                        config: Config | None = None) -> dict[str, Any]:
    """The stream and group of ``source``, and its group's lag and pending entries
    (None when the server cannot tell, or the stream or the group is missing)."""
    assert isinstance(source, StreamSource)
    found = await _group_info(redis, source)
    return {"stream": source.stream, "group": source.group,
            "lag": _int(found.get("lag")), "pending": _int(found.get("pending"))}


async def _group_info(redis: Any, source: StreamSource) -> dict[str, Any]:
    """The group's XINFO GROUPS entry; empty when the stream or the group is missing."""
    try:
        groups = await redis.xinfo_groups(source.stream)
    except ResponseError:  # no such key, or it is not a stream
        return {}
    for group in groups:
        if group.get("name") == source.group:
            return dict(group)
    return {}


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


register(SourceType(name=StreamSource.type, open=open_streams, status=stream_status))
