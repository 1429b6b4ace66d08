"""Outbox sources: rows that the application wrote in its own transactions become touches.

Each worker node claims each outbox source's rows, ``batch`` at a time, in id order;
touches their keys, flushes and only then deletes the rows (``outbox_db`` says how, per
database); a row that cannot become a touch is deleted too and counted as rejected (the
guarantees: docs/sources.md, "The outbox source"). A source with ``at:`` or ``delay:``
reads the columns its template names with each row.

``drain()`` reads an outbox once (``OutboxLoop.read_now``): every row whose id is at most
the highest one in the table when it starts, claimed, touched and deleted batch by
batch as above, never at the same time as the node's own loop (they share a lock).

What a node last saw (backlog, lag, error) is kept in Redis for ``coalescer status``:
written when it changes, and every 30 s at least.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coalescer.common.redact import redact
from coalescer.common.retrying import Backoff, keep_running
from coalescer.config.rules import Config
from coalescer.config.sources import (
    OutboxSource,
    SourceConfig,
    outbox_scheme,
    outbox_url_problem,
    source_error,
)
from coalescer.errors import ConfigError, UnknownKeyError, shown_key
from coalescer.sources.base import (
    LoopSources,
    NodeContext,
    SourceType,
    register,
)
from coalescer.sources.outbox_db import Backlog, Outbox, Row, driver_problem, open_outbox
from coalescer.sources.times import Timed, time_of
from coalescer.store.keycheck import item_problem, key_problem
from coalescer.store.keys import sources_outbox, sources_rejected

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 10.0  # seconds a claim waits for Redis to hold its touches; then it undoes
MEASURE_EVERY = 2.0  # seconds between two counts of a busy (or failing) outbox's backlog
REPORT_EVERY = 30.0  # seconds between two status reports of an unchanged outbox
REPORT_STALE = 3 * REPORT_EVERY  # a report older than this is a gone node's
REJECTS_LOGGED = 20
_COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def rules_dir(config: Config) -> Path:
    """Where a relative SQLite path starts: the rules file's folder (else the cwd)."""
    source = config.source
    if source.startswith("<") and source.endswith(">"):
        return Path.cwd()
    return Path(source).resolve().parent


class OutboxLoop:
    """Claims one outbox source's rows and turns them into touches."""

    def __init__(self, source: OutboxSource, outbox: Outbox, context: NodeContext,
                 shown_url: str) -> None:
        self.source = source
        self._outbox = outbox
        self._context = context
        self._shown_url = shown_url
        self._redis = context.conn.client
        self._report_field = f"{source.name}|{context.node_id}"
        self._full = True  # measure the backlog once at start
        self._failing = False  # the last step failed, in the database or Redis
        self._reconnect = True  # connect before the next claim: first, or after a failure
        self._error: str | None = None
        self._errors = 0
        self._backlog: Backlog | None = None
        self._measured = 0.0
        self._reported: tuple[Any, ...] | None = None
        self._report_at = 0.0
        self._lock = asyncio.Lock()  # one claim at a time: the loop's or a drain's
        self.accepted = 0
        self.rejected = 0

    @property
    def what(self) -> str:
        """The table and database read, as errors and logs name them."""
        return f"outbox {self.source.table} at {self._shown_url}"

    async def run(self) -> None:
        """The loop: survives database and Redis errors; backs off."""
        await keep_running(f"source {self.source.name}: {self.what}", self.step,
                           backoff=Backoff(base=0.1, cap=5.0), logger=log,
                           on_error=self._failed, pause=self._pause)

    def _failed(self, exc: Exception) -> None:
        self._failing = True
        self._errors += 1
        self._error = redact(f"{type(exc).__name__}: {exc}".strip())
        self._context.metrics.outbox_errors.labels(self.source.name).inc()

    async def _pause(self, delay: float) -> None:
        with contextlib.suppress(Exception):  # the database or Redis may be what failed
            await asyncio.wait_for(self._report(), 2.0)
        await asyncio.sleep(delay)

    async def step(self) -> int:
        """One claim and its handling; waits for more rows when the outbox ran dry."""
        async with self._lock:
            count = await self._take()
        if not self._full:
            await self._outbox.wait(self.source.poll)
        return count

    async def read_now(self) -> int:
        """Claim and handle, batch by batch, every row in the table now (ids up to the
        highest one there as it starts); how many rows. Raises what the database or
        Redis raises: the rows not yet deleted stay in the table."""
        async with self._lock:
            await self._connected()
            self._reconnect = True
            newest = await self._outbox.newest()
            self._reconnect = False
            total = 0
            while newest is not None:
                count = await self._take(newest)
                total += count
                if count < self.source.batch:
                    break
            return total

    async def _connected(self) -> None:
        if self._reconnect:
            await self._outbox.connect()
            self._reconnect = False

    async def _take(self, up_to: int | None = None) -> int:
        """One claim (of the rows with ids up to ``up_to``, if given) and its handling."""
        await self._connected()
        self._reconnect = True  # until the claim is in hand: a failure is the database's
        rows = await self._outbox.claim(self.source.batch, up_to)
        self._reconnect = False
        keys, pairs, rejected = self._split(rows)
        timed = self._with_times(rows, keys, pairs, rejected)
        await self._touch(list(dict.fromkeys(keys)), list(dict.fromkeys(pairs)), timed)
        self._reconnect = True
        await self._outbox.done()
        self._reconnect = False
        await self._count(len(keys) + len(pairs) + len(timed), rejected)
        self._failing = False
        self._error = None
        self._full = len(rows) >= self.source.batch
        await self._report()
        return len(rows)

    def _with_times(self, rows: Sequence[Row], keys: list[str], pairs: list[tuple[str, str]],
                    rejected: list[str]) -> list[Timed]:
        """With ``at:``/``delay:``: every touch of ``keys`` and ``pairs`` (emptied) with
        its row's time; a row whose time cannot be made goes to ``rejected``."""
        if self.source.at is None and self.source.delay is None:
            return []
        timed: list[Timed] = []
        for (key, item), fields in zip(rows, self._outbox.fields, strict=True):
            if self.problem(key, item) is not None:
                continue  # rejected already
            spec, why = time_of(self.source, key, fields.get,
                                self._context.config.limits.max_schedule_ahead)
            if spec is None:
                rejected.append(f"key {shown_key(key)}: {why}")
            else:
                timed.append((key, item, spec))
        keys.clear()
        pairs.clear()
        return timed

    async def _touch(self, keys: list[str], pairs: list[tuple[str, str]],
                     timed: list[Timed]) -> None:
        """Touch ``keys`` (and each key of ``pairs`` with its item, each of ``timed`` with
        its time) and wait until Redis holds them; on failure the rows stay."""
        if not keys and not pairs and not timed:
            return
        try:
            if timed:
                assert self._context.touch_timed is not None
                self._context.touch_timed(timed)
            if pairs:
                assert self._context.touch_items is not None  # _split rejects them else
                self._context.touch_items(pairs)
            if keys:
                self._context.touch_many(keys)
            await asyncio.wait_for(self._context.flush(), FLUSH_TIMEOUT)
        except BaseException:
            try:
                await asyncio.shield(self._outbox.undo())
            except Exception:  # the connection is gone: its rows went back with it
                self._reconnect = True
            raise

    def _split(self, rows: Sequence[tuple[str, str | None]]) -> tuple[
            list[str], list[tuple[str, str]], list[str]]:
        """The key of each plain row, the (key, item) of each row with an item, and why
        each rejected row is."""
        keys: list[str] = []
        pairs: list[tuple[str, str]] = []
        rejected: list[str] = []
        for key, item in rows:
            why = self.problem(key, item)
            if why is not None:
                rejected.append(why)
            elif item is None:
                keys.append(key)
            else:
                pairs.append((key, item))
        return keys, pairs, rejected

    def problem(self, key: Any, item: Any = None) -> str | None:
        """Why a row cannot be touched, or None."""
        problem = key_problem(key)
        if problem is not None:
            return f"key {shown_key(key)} cannot be stored: {problem}"
        try:
            rule = self._context.config.rule_for(key)
        except UnknownKeyError:
            return f"no rule matches key {shown_key(key)}"
        if item is None:
            return None
        problem = item_problem(item)
        if problem is None and (rule.items is None or self._context.touch_items is None):
            problem = f"the rule of key {shown_key(key)} takes no items"
        return None if problem is None else f"item {shown_key(item)} cannot be touched: {problem}"

    async def _count(self, accepted: int, rejected: list[str]) -> None:
        counter = self._context.metrics.source_entries
        if accepted:
            self.accepted += accepted
            counter.labels(self.source.name, "accepted").inc(accepted)
        if not rejected:
            return
        self.rejected += len(rejected)
        counter.labels(self.source.name, "rejected").inc(len(rejected))
        for why in rejected[:REJECTS_LOGGED]:
            log.warning("source %s: row of table %s rejected (deleted, not touched): %s",
                        self.source.name, self.source.table, why)
        if len(rejected) > REJECTS_LOGGED:
            log.warning("source %s: %d more rows of table %s rejected", self.source.name,
                        len(rejected) - REJECTS_LOGGED, self.source.table)
        await self._redis.hincrby(sources_rejected(self._context.config.namespace),
                                  self.source.name, len(rejected))

    async def _measure(self) -> None:
        """Count the backlog when rows may wait: the last claim was full, or failed."""
        now = time.monotonic()
        if not (self._full or self._failing):
            self._backlog = Backlog(0, False, 0.0)
        elif now - self._measured >= MEASURE_EVERY:
            self._measured = now
            try:
                self._backlog = await self._outbox.backlog()
            except Exception:  # the database is down: the backlog is unknown
                self._backlog = None
        gauges = self._context.metrics
        if self._backlog is not None:
            gauges.outbox_backlog.labels(self.source.name).set(self._backlog.rows)
            gauges.outbox_lag.labels(self.source.name).set(self._backlog.lag)

    async def _report(self) -> None:
        """Keep what this node sees in Redis: when it changes, and every REPORT_EVERY."""
        await self._measure()
        b = self._backlog
        shown = (None if b is None else b.rows, None if b is None else round(b.lag),
                 self._error)
        now = time.monotonic()
        if shown == self._reported and now - self._report_at < REPORT_EVERY:
            return
        entry = {"backlog": None if b is None else b.rows, "capped": bool(b and b.capped),
                 "lag": None if b is None else round(b.lag, 3), "error": self._error,
                 "errors": self._errors, "at_ms": round(time.time() * 1000)}
        await self._redis.hset(sources_outbox(self._context.config.namespace),
                               self._report_field, json.dumps(entry))
        self._reported, self._report_at = shown, now

    async def forget(self) -> None:
        """Drop this node's report (it stops)."""
        await self._redis.hdel(sources_outbox(self._context.config.namespace),
                               self._report_field)


class OutboxSources(LoopSources[OutboxLoop]):
    """Every outbox source's loop on one worker node."""

    def __init__(self, loops: list[OutboxLoop], outboxes: list[Outbox]) -> None:
        super().__init__(loops)
        self._outboxes = outboxes

    async def stop(self) -> None:
        """Stop claiming (rows claimed and not yet deleted stay in the table), close.
        The connections are closed even when the stop is cut short (a shutdown gives it
        a deadline): a connection left open keeps its thread, or its server session."""
        try:
            await self.cancel_loops()
            for loop in self.loops:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(loop.forget(), 2.0)
        finally:
            for outbox in self._outboxes:
                with contextlib.suppress(Exception):
                    await outbox.close()


def _outboxes(sources: Sequence[SourceConfig]) -> list[OutboxSource]:
    return [source for source in sources if isinstance(source, OutboxSource)]


def open_outboxes(sources: Sequence[SourceConfig], context: NodeContext) -> OutboxSources:
    """The loops of the outbox ``sources``, each on connections of its own (opened by its
    first claim, so a database that is down delays the source, never the node)."""
    loops, outboxes = [], []
    for source in _outboxes(sources):
        url = source.resolved(os.environ)
        outbox = open_outbox(source, url, rules_dir(context.config))
        loops.append(OutboxLoop(source, outbox, context, redact(url)))
        outboxes.append(outbox)
    return OutboxSources(loops, outboxes)


def check_outbox(source: SourceConfig, index: int, config: Config,
                 environ: Mapping[str, str]) -> list[ConfigError]:
    """Why ``source`` cannot run on this node: an environment variable of its url not
    set, a url that is no outbox's, or its database's driver not installed."""
    assert isinstance(source, OutboxSource)
    for name in source.time_fields:  # each a column of the table
        if _COLUMN.fullmatch(name) is None:
            which = "at" if source.at is not None else "delay"
            return [source_error(source, index, config.source,
                                 f"{{{name}}} must name a column of the outbox table "
                                 "(letters, digits and '_')", which)]
    try:
        url = source.resolved(environ)
    except KeyError as exc:
        return [source_error(source, index, config.source,
                             f"url uses the environment variable {exc.args[0]}, which is "
                             "not set (or empty)", "url")]
    problem = outbox_url_problem(url)
    if problem is not None:
        return [source_error(source, index, config.source,
                             f"url {redact(url)!r} {problem}", "url")]
    scheme = outbox_scheme(url)
    assert scheme is not None
    problem = driver_problem(scheme)
    if problem is not None:
        return [source_error(source, index, config.source, problem, "url")]
    return []


async def outbox_status(redis: Any, source: SourceConfig, config: Config) -> dict[str, Any]:
    """What the live nodes last saw of ``source``: the freshest backlog and lag, and
    every node's error (None where the nodes have not said, or none runs)."""
    assert isinstance(source, OutboxSource)
    found = await redis.hgetall(sources_outbox(config.namespace))
    now_ms = time.time() * 1000
    reports = []
    prefix = f"{source.name}|"
    for field, raw in found.items():
        if field.startswith(prefix):
            with contextlib.suppress(ValueError):
                entry = json.loads(raw)
                if now_ms - entry["at_ms"] <= REPORT_STALE * 1000:
                    reports.append((field[len(prefix):], entry))
    reports.sort(key=lambda pair: pair[1]["at_ms"])
    latest = reports[-1][1] if reports else {}
    return {"type": "outbox", "table": source.table, "url": redact(source.url),
            "backlog": latest.get("backlog"), "backlog_capped": latest.get("capped", False),
            "lag_seconds": latest.get("lag"), "nodes": len(reports),
            "errors": {node: entry["error"] for node, entry in reports if entry["error"]}}


register(SourceType(name=OutboxSource.type, open=open_outboxes, status=outbox_status,
                    check=check_outbox))
