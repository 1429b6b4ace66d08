"""``Coalescer``: the façade that ties touch, flush, drain, reads and a node's lifecycle.

What one start creates (the connection, the flusher, the worker node, the
background tasks, the touch buffer) lives in one ``Run``; a forked child parks
its parent's run whole, never closing it, and starts over with a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from coalescer.claim import Claim
from coalescer.common import forksafe
from coalescer.common.audit_log import local_user
from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.config.code_rules import Rules, rules_config
from coalescer.config.rules import Config
from coalescer.config.schedule import At, Delay, schedule_spec
from coalescer.errors import (
    BackpressureError,
    ClosedError,
    CoalescerError,
    ConfigError,
    InvalidItemError,
    UnknownKeyError,
    UnwrittenTouchesError,
)
from coalescer.query.reader import Query
from coalescer.sources.base import NodeContext as SourceContext
from coalescer.sources.base import (
    Source,
    check_sources,
    open_sources,
    read_sources,
    start_sources,
    stop_sources,
)
from coalescer.store import embedded_watch
from coalescer.store.connection import Connection, connect
from coalescer.store.embedded import (
    ENV_REDIS_URL,
    EmbeddedServer,
    RootChoice,
    find_root,
    resolve_redis_url,
)
from coalescer.store.eviction import PolicyWatch, check_at_start
from coalescer.store.hints import CommandHints
from coalescer.store.keycheck import check_item, check_key, key_problem
from coalescer.store.keys import KeySpace
from coalescer.store.layout import Layouts
from coalescer.store.redis_failures import check_url, explained
from coalescer.store.scripts import History, Scripts
from coalescer.tracing import touch_traces
from coalescer.worker.context import NodeContext
from coalescer.worker.drain import Drainer, ReadSources, local_runner
from coalescer.worker.handlers import Handlers
from coalescer.worker.lease_clock import ServerClock
from coalescer.worker.node import Node
from coalescer.worker.resharding import begin_reshard
from coalescer.worker.runner import Runner
from coalescer.write.absorber import Absorber
from coalescer.write.cancel import CancelOutcome, cancel_keys
from coalescer.write.cancel_scheduled import bulk_cancel, cancel_rule_scheduled
from coalescer.write.flusher import Flusher
from coalescer.write.quota import Quota
from coalescer.write.room import DEFAULT_TIMEOUT, Wanted, touch_blocking, touch_waiting

if TYPE_CHECKING:
    from coalescer.tracing.touches import TouchTraces

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED = 100_000
CLOSE_FLUSH_TIMEOUT = 10.0  # seconds close() keeps trying to write the buffered touches


def default_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Run:
    """What one start of a coalescer creates and owns, from its touch buffer to its
    background tasks. A forked child parks its parent's run, never closing it."""

    def __init__(self, absorber: Absorber) -> None:
        self.absorber = absorber
        self.metrics = Metrics()
        self.seen: tuple[int, int] = (0, 0)  # the absorber's counts last synced to metrics
        self.waits_seen = (0, 0)  # and its waits: for room, for the flusher's take
        self.conn: Connection | None = None
        self.embedded: EmbeddedServer | None = None
        self.scripts: Scripts | None = None
        self.layouts: Layouts | None = None
        self.flusher: Flusher | None = None
        self.policy: PolicyWatch | None = None
        self.quota: Quota | None = None
        self.node: Node | None = None
        self.handlers: Handlers | None = None
        self.sources: list[Source] = []
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"coalescer {name}")
        task.add_done_callback(_task_ended)
        self.tasks.append(task)

    async def stop_sources(self) -> None:
        sources, self.sources = self.sources, []
        await stop_sources(sources)

    async def stop_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        done, stuck = await asyncio.wait(self.tasks, timeout=5.0) if self.tasks else ((), ())
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.warning("shutdown: %s had failed: %r", task.get_name(), task.exception())
        if stuck:
            log.warning("shutdown: %d background tasks did not stop within 5s: %s",
                        len(stuck), ", ".join(t.get_name() for t in stuck))

    async def close_resources(self) -> None:
        if self.handlers is not None:
            await self.handlers.close()
        if self.conn is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.conn.close()
        self.release_embedded()

    def release_embedded(self) -> None:
        if self.embedded is not None:
            self.embedded.release()
            self.embedded = None


def _refuse_sources_that_cannot_run(config: Config) -> None:
    """A worker does not start with a source it could not run (its database's driver
    not installed, an environment variable of its URL not set): ConfigError naming
    the file, line and field of each."""
    problems = check_sources(config, os.environ) if config.sources else []
    if problems:
        raise ConfigError.combine(problems)


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


def _task_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died: %r", task.get_name(), task.exception(),
                  exc_info=task.exception())


def _the_rules(config: Config | Rules | None, rules: Config | Rules | None) -> Config:
    """The Config given either way (positionally, or as ``rules=``); exactly one."""
    if config is not None and rules is None:
        return rules_config(config)
    if rules is not None and config is None:
        return rules_config(rules)
    raise TypeError("give the rules once: Coalescer(config) (e.g. Config.from_yaml(path)) "
                    "or Coalescer(rules=Rules(...))")


class Coalescer:
    """Debounce and coalesce refreshes, across every process and node, on Redis.

    ``touch(key)`` is sync and cheap; ``await flush()`` returns once Redis holds
    every earlier touch. With ``worker=True`` this process also joins the leader
    election and runs refresh handlers. Reads (status, explain, history, dead
    letters) are on ``query``. Use as ``async with``.

    In a process forked from one where it was started, it stops with a ClosedError
    saying so until ``start()`` is awaited again there (the parent's connections and
    buffered touches stay the parent's); one created but not started is simply
    started in the child.
    """

    def __init__(self, config: Config | Rules | None = None, *,
                 rules: Config | Rules | None = None, redis_url: str | None = None,
                 worker: bool = True,
                 node_id: str | None = None, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 grace: float = 30.0, embedded_root: Path | None = None,
                 refuse_evicting_policy: bool = True) -> None:
        config = _the_rules(config, rules)  # Coalescer(config) or Coalescer(rules=Rules(...))
        self.config = config.with_handlers() if worker else config  # only workers call them
        if worker:
            _refuse_sources_that_cannot_run(self.config)
        self.worker = worker
        self._given_node_id = node_id
        self.node_id = node_id or default_node_id()
        self.grace = grace
        self._keyspace = KeySpace(config.namespace, config.shards)
        if redis_url:
            check_url(redis_url, "redis_url")  # RedisUrlError, saying what to write
        self._redis_url = redis_url
        self._embedded_root = embedded_root
        self._max_buffered = max_buffered
        self._refuse_evicting = refuse_evicting_policy  # False: reading tools only warn
        self._run = self._new_run()
        self._traces: TouchTraces | None = None  # the touches' span contexts (tracing on)
        self._record: Callable[[str], None] | None = None  # its record(), on the hot path
        self._query = Query(lambda: self.config, self._connected, self._explained)
        self._state = "new"
        self._closed = asyncio.Event()
        self._pid = os.getpid()
        self._forked_from: int | None = None
        forksafe.track(self)
        self.hints = CommandHints.of(config.source, redis_url)
        """The options a printed `coalescer` command needs to reach these rules and server."""

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **options: Any) -> Coalescer:
        """Load and validate ``path``, then build a coalescer on it. Handler
        modules are imported only with ``worker=True``: a writer never calls them."""
        worker = options.get("worker", True)
        return cls(Config.from_yaml(path, import_handlers=worker), **options)

    def _new_run(self) -> Run:
        run = Run(Absorber(self.config.rule_for, max_keys=self._max_buffered))
        self._absorber = run.absorber  # the run's, held here too: touch() is the hot path
        return run

    # -- the write path --------------------------------------------------------------

    def touch(self, key: str, item: str | None = None, *, at: At | None = None,
              delay: Delay | None = None, keep_items: bool = False) -> None:
        """Mark ``key`` stale: its rule's handler runs once, a quiet window later.

        With ``at`` (an aware datetime, epoch seconds, or ISO-8601 text with an offset)
        or ``delay`` (seconds, or a duration string such as "30m"), the key is due at
        exactly that time instead (Redis server clock; a delay counts from when Redis
        takes the touch), replacing any due time it had; a plain touch after it moves it
        as usual. A time that cannot be read, a naive datetime, a negative delay, both
        given, one before 1970 or more than the rules file's
        ``limits.max_schedule_ahead`` (400 days by default) ahead raises
        InvalidScheduleError (naming the key, the time and the limit) and touches nothing.
        A schedule replaces the key's burst, and the items it had with it (the refresh
        gets only the items touched with or after it); ``keep_items=True`` keeps them.

        Sync and safe from any thread; it never waits on Redis (a touch of a new key
        pauses 5 ms at most when the background writer fell behind by thousands of
        keys, so that it gets its turn). With ``item`` (a short string, e.g. a
        changed row's id; the key's rule must have ``items:``), the refresh's
        ``claim.items`` will hold it. Raises UnknownKeyError for a key no rule matches,
        InvalidKeyError for one Redis cannot store (not UTF-8, a NUL character, over
        1024 bytes), InvalidItemError for an item that is not a non-empty str of at most
        256 bytes without NUL, or of a rule without items, BackpressureError when the
        buffer is full (QuotaExceededError, one of them, when the keys waiting for
        their refresh reached the rules file's ``limits.pending_keys``), ClosedError
        when the coalescer is not running.
        """
        if self._state != "running":
            raise self._not_running(f"touch({key!r})")
        self._check_quota()
        if at is not None or delay is not None:
            spec = _spec([key], at, delay, self._ahead, keep_items)
            self._absorber.touch_scheduled(key, spec or "", item)
        elif item is None:
            self._absorber.touch(key)
        else:
            self._absorber.touch_item(key, item)
        if self._record is not None:
            self._record(key)

    def touch_items(self, pairs: Iterable[tuple[str, str]], *, keys: Iterable[str] = (),
                    at: At | None = None, delay: Delay | None = None,
                    keep_items: bool = False) -> None:
        """Touch each key of the ``(key, item)`` pairs with its item, and each of ``keys``
        plainly: every one or none (UnknownKeyError, InvalidKeyError, InvalidItemError,
        InvalidScheduleError, BackpressureError, ClosedError). ``at``/``delay``,
        ``keep_items``: the time of every one of them (see ``touch``)."""
        if self._state != "running":
            raise self._not_running("touch_items()")
        self._check_quota()
        pairs, keys = list(pairs), list(keys)
        spec = _spec([k for k, _ in pairs] + keys, at, delay, self._ahead, keep_items)
        self._run.absorber.touch_items(pairs, keys, spec)
        self._record_all([*(k for k, _ in pairs), *keys])

    def touch_many(self, keys: Iterable[str], *, at: At | None = None,
                   delay: Delay | None = None, keep_items: bool = False) -> None:
        """Touch every key or none (UnknownKeyError, InvalidKeyError, InvalidScheduleError,
        BackpressureError, ClosedError). ``at``/``delay``, ``keep_items``: the time of
        every one of them (see ``touch``); checked, with every key, before any is buffered."""
        if self._state != "running":
            raise self._not_running("touch_many()")
        self._check_quota()
        keys = list(keys)
        self._run.absorber.touch_many(keys, _spec(keys, at, delay, self._ahead, keep_items))
        self._record_all(keys)

    async def touch_wait(self, key: str, item: str | None = None, *,
                         timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                         delay: Delay | None = None) -> None:
        """``touch(key)`` that waits while the buffer is full, for bulk writers.

        Returns once the touch is buffered, as ``touch`` does; while the buffer is
        full it waits (without blocking the event loop) until the flusher has written
        keys to Redis, for at most ``timeout`` seconds (None: no bound), then raises
        BackpressureError. The other errors are ``touch``'s.
        """
        if self._state != "running":
            raise self._not_running(f"touch_wait({key!r})")
        self._check_quota()
        try:
            self.touch(key, item, at=at, delay=delay)  # room in the buffer: as cheap as touch
        except BackpressureError:
            keys, pairs = ([key], []) if item is None else ([], [(key, item)])
            spec = _spec([key], at, delay, self._ahead)
            await touch_waiting(self._absorber, Wanted(keys, pairs, spec), timeout,
                                f"touch_wait({key!r})")
            self._record_all([key])

    async def touch_many_wait(self, keys: Iterable[str], *,
                              timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                              delay: Delay | None = None) -> None:
        """Touch every key, waiting while the buffer is full (see ``touch_wait``).

        Every key is checked first: one that is refused (UnknownKeyError,
        InvalidKeyError) touches nothing. Keys are buffered in order as room frees,
        so any number of keys fit; on timeout, BackpressureError says how many were
        buffered (those are written, the rest are not touched).
        """
        if self._state != "running":
            raise self._not_running("touch_many_wait()")
        self._check_quota()
        keys = list(keys)
        spec = _spec(keys, at, delay, self._ahead)
        await touch_waiting(self._run.absorber, Wanted(keys, (), spec), timeout,
                            "touch_many_wait()")
        self._record_all(keys)

    async def touch_items_wait(self, pairs: Iterable[tuple[str, str]], *,
                               timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                               delay: Delay | None = None) -> None:
        """``touch_items`` that waits while the buffer is full, as ``touch_many_wait``
        does (every pair is checked first; on timeout, BackpressureError says how many
        went in)."""
        if self._state != "running":
            raise self._not_running("touch_items_wait()")
        self._check_quota()
        pairs = list(pairs)
        spec = _spec([k for k, _ in pairs], at, delay, self._ahead)
        await touch_waiting(self._run.absorber, Wanted([], pairs, spec), timeout,
                            "touch_items_wait()")
        self._record_all([k for k, _ in pairs])

    def touch_blocking(self, keys: Iterable[str], *, timeout: float | None = DEFAULT_TIMEOUT,
                       what: str = "touch_blocking()",
                       pairs: Iterable[tuple[str, str]] = (), at: At | None = None,
                       delay: Delay | None = None) -> None:
        """``touch_many_wait`` for a thread that is not running an event loop: blocks
        it while the buffer is full (``SyncCoalescer.touch_wait`` is this)."""
        if self._state != "running":
            raise self._not_running(what)
        self._check_quota()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"{what} would block the event loop running in this "
                               "thread (and the flusher that frees room): await "
                               "touch_wait() or touch_many_wait() instead")
        keys, pairs = list(keys), list(pairs)
        spec = _spec(keys + [k for k, _ in pairs], at, delay, self._ahead)
        touch_blocking(self._run.absorber, Wanted(keys, pairs, spec), timeout, what)

    @property
    def _ahead(self) -> float:
        return self.config.limits.max_schedule_ahead

    def _check_quota(self) -> None:
        """QuotaExceededError when the pending keys reached ``limits.pending_keys``."""
        quota = self._run.quota
        if quota is not None:
            quota.check()

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` that no rule matches (nothing is touched)."""
        out = []
        for key in keys:
            try:
                self.config.rule_for(key)
            except UnknownKeyError:
                out.append(key)
        return out

    async def cancel(self, key: str) -> CancelOutcome:
        """Drop ``key``'s pending refresh; see ``cancel_many``."""
        return await self.cancel_many([key])

    async def cancel_many(self, keys: Iterable[str]) -> CancelOutcome:
        """Drop the keys' pending refreshes: touches made before this call are not
        refreshed, a touch after it arms its key again as usual.

        A pending key (in retry backoff too) leaves its due set, attempts and all. A
        running key's refresh finishes as usual, but the re-run its touches during
        the run had queued is dropped. Touches of the keys still buffered in this
        process are dropped too. Returns a CancelOutcome: ``cancelled`` (the keys
        whose refresh was dropped) and ``not_pending`` (idle, dead-lettered, or
        running with nothing queued after it), with each key's state in ``states``.
        Each key cancelled in Redis gets a history entry (outcome "cancelled").

        Every key is checked first: UnknownKeyError or InvalidKeyError cancels nothing.
        ClosedError when the coalescer is not running. A Redis error is raised as is;
        the keys' buffered touches may be dropped by then: cancel again.
        """
        keys = list(dict.fromkeys(keys))
        if self._state != "running":
            raise self._not_running("cancel()")
        rules: dict[str, str] = {}
        for key in keys:
            check_key(key)
            rules[key] = self.config.rule_for(key).name
        run = self._run
        assert run.flusher is not None and run.scripts is not None
        async with self._explained():
            buffered = await run.flusher.forget(keys)
            outcome = await cancel_keys(run.scripts, self.keyspace, rules,
                                        history=History(self.node_id, self.config.history),
                                        buffered=buffered)
        for key in outcome.cancelled:
            run.metrics.cancels.labels(rules[key]).inc()
        log.info("cancel: %d of %s dropped (%d not pending)", outcome.done,
                 plural(len(keys), "key"), len(outcome.not_pending))
        return outcome

    async def cancel_scheduled(self, rule: str, *, after: At, dry_run: bool = False,
                               who: str | None = None) -> int:
        """Cancel every pending key of ``rule`` whose own time (``at``/``delay``) is
        after ``after``, a page at a time (write/cancel_scheduled.py); how many (only
        counted with ``dry_run``). Logged at INFO with ``who`` (default: the local
        user). KeyError for an unknown rule, InvalidScheduleError for a bad time."""
        if self._state != "running":
            raise self._not_running("cancel_scheduled()")
        assert self._run.scripts is not None
        bulk = bulk_cancel(self.config, rule, after, self.node_id, dry_run)
        return await cancel_rule_scheduled(self._run.scripts.client, self.keyspace, bulk,
                                           who or local_user())

    def refused_items(self, pairs: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
        """The (key, item) touches of ``pairs`` that would be refused for their item or
        key (not UTF-8, NUL, too long, empty, a rule without items), each as ``{"index",
        "key", "item", "error"}`` (a key no rule matches is ``unknown_keys``'s)."""
        out = []
        for index, (key, item) in enumerate(pairs):
            problem = key_problem(key)
            if problem is None:
                try:
                    rule = self.config.rule_for(key)
                except UnknownKeyError:
                    continue
                try:
                    check_item(key, item, rule.name, rule.items is not None)
                except InvalidItemError as exc:
                    problem = exc.reason
            else:
                problem = f"key cannot be stored: {problem}"
            if problem is not None:
                out.append({"index": index, "key": key, "item": item, "error": problem})
        return out

    async def flush(self) -> None:
        """Return once Redis holds the due time of every touch made before this call."""
        self.after_fork()
        if self._run.flusher is None:
            raise self._not_running("flush()")
        async with self._explained():  # RedisConnectError says what to check
            await self._run.flusher.flush()
        self.sync_metrics()

    @property
    def metrics(self) -> Metrics:
        """This coalescer's metrics (``metrics.registry`` is what /metrics serves)."""
        return self._run.metrics

    def sync_metrics(self) -> None:
        """Bring the touch counters of ``metrics`` up to date (they sync every second)."""
        run = self._run
        touches, absorbed = run.absorber.touches, run.absorber.absorbed
        run.metrics.touches.inc(touches - run.seen[0])
        run.metrics.absorbed.inc(absorbed - run.seen[1])
        run.seen = (touches, absorbed)
        waits = (run.absorber.waits, run.absorber.waited_for_take)
        run.metrics.touch_waits.inc(waits[0] - run.waits_seen[0])
        run.metrics.flusher_waits.inc(waits[1] - run.waits_seen[1])
        run.waits_seen = waits

    def unwritten_age(self) -> float | None:
        """Seconds since the oldest touch not yet in Redis was made; None if there is none."""
        since = self._run.absorber.oldest_unwritten()
        return None if since is None else time.monotonic() - since

    def dropped_keys(self) -> list[dict[str, Any]]:
        """The last keys dropped because Redis refused them for good, oldest first."""
        flusher = self._run.flusher
        return [d.as_json() for d in flusher.dropped] if flusher else []

    async def drain(self, timeout: float = 30.0, *, sources: bool = True) -> list[Claim]:
        """Run everything pending now through this process's handlers, windows and
        retry backoff skipped, and return the claims run, in the order they started.

        Meant for tests. First reads what the rules file's ``sources:`` hold now
        (outbox rows, stream entries, Kafka messages), as a running source would:
        touched, flushed, then deleted, acknowledged or committed. Then flushes this
        process's touches; drains touches that the handlers make through this
        coalescer too (and source events they write: the sources are read again each
        round), until nothing of its rules is pending or in flight in Redis. Works
        with ``worker=False`` as well: the handlers then run here, and the sources are
        opened here, for the drain's length (closed after). Claims are taken as a
        leader takes them (fencing tokens, leases), whichever node leads; what another
        node runs meanwhile is waited for but not returned. A failing handler is
        retried at once until its attempts run out (dead-lettered, in the list once
        per attempt). Raises TimeoutError naming the keys left after ``timeout``, and
        SourceReadError naming a source that cannot be read (or did not answer
        within ``timeout``). ``sources=False`` leaves the sources unread.
        """
        if self._state != "running":
            raise self._not_running("drain()")
        run = self._run
        async with self._sources_for_drain(sources) as read:
            if run.node is not None:
                return await self._drainer(run.node.runner, read).run(timeout)
            if run.handlers is None:
                self.config = self.config.with_handlers()  # a writer's drain imports them
                run.handlers = Handlers(self.config, processes=False)  # in this process
            async with local_runner(self._context(), invokers=run.handlers.invokers) as runner:
                return await self._drainer(runner, read).run(timeout)

    def _drainer(self, runner: Runner, read: ReadSources | None) -> Drainer:
        return Drainer(self._context(), runner=runner, flush=self.flush, redis=self.redis,
                       read_sources=read)

    @contextlib.asynccontextmanager
    async def _sources_for_drain(self, wanted: bool) -> AsyncIterator[ReadSources | None]:
        """What reads the rules file's sources once, for a drain: a worker's running
        sources, else the sources opened for the drain's length (closed after)."""
        run = self._run
        if not wanted or not self.config.sources:
            yield None
            return
        running = run.sources
        if running:
            yield lambda deadline: read_sources(running, deadline)
            return
        _refuse_sources_that_cannot_run(self.config)
        opened = open_sources(self._source_context(run), for_drain=True)
        try:
            yield lambda deadline: read_sources(opened, deadline)
        finally:
            await stop_sources(opened)

    @property
    def keyspace(self) -> KeySpace:
        """How keys map to shards now: the namespace's layout in Redis (read at start,
        and again when it changes), or the rules file's count before the first read."""
        layouts = self._run.layouts
        return layouts.keyspace if layouts is not None else self._keyspace

    def _context(self) -> NodeContext:
        run = self._run
        assert run.scripts is not None and run.layouts is not None and run.conn is not None
        return NodeContext(scripts=run.scripts, keyspace=self.keyspace, layouts=run.layouts,
                           metrics=run.metrics,
                           node_id=self.node_id, config=self.config, hints=self.hints,
                           clock=None if run.conn.cluster else ServerClock())

    # -- the connection and reads ----------------------------------------------------

    @property
    def redis(self) -> Any:
        if self._run.conn is None:
            raise ClosedError("the coalescer is not connected")
        return self._run.conn.client

    def _connected(self) -> tuple[Any, Scripts]:
        client = self.redis
        assert self._run.scripts is not None
        return client, self._run.scripts

    @property
    def query(self) -> Query:
        """Reads and dead-letter operations: ``status()``, ``explain(key)``,
        ``history()``, ``next_due()``, ``dead_letters()``, ``retry_dead()``,
        ``purge_dead()`` (ClosedError while not connected)."""
        return self._query

    @property
    def redis_url(self) -> str | None:
        """The URL in use (with its password: show ``redact(redis_url)``, never this)."""
        conn = self._run.conn
        return conn.url if conn else self._redis_url

    @property
    def embedded_root(self) -> Path | None:
        """The folder of the embedded server, while this coalescer runs on it."""
        embedded = self._run.embedded
        return embedded.root if embedded is not None else None

    @property
    def embedded_reason(self) -> str | None:
        """Why the embedded server's folder is the one it is (the search for the nearest
        ``.coalescer/`` and where it stopped), while this coalescer runs on it."""
        embedded = self._run.embedded
        return embedded.reason if embedded is not None else None

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # Started, never closed, now dropped: its buffered touches die with it (asyncio
        # and aiohttp warn so of an unclosed loop or session).
        if getattr(self, "_state", None) not in ("starting", "running") or (
                self._pid != os.getpid()):
            return
        keys = len(self._run.absorber.unwritten_keys())
        text = (f"coalescer {self.node_id} was never closed: {plural(keys, 'touched key')} "
                "not written to Redis are lost; use 'async with Coalescer(...)' or "
                "'await coalescer.close()'")
        _warn(text, ResourceWarning, source=self)
        log.warning("%s", text)

    def __repr__(self) -> str:
        url = redact(self.redis_url) if self.redis_url else None
        return f"Coalescer(node_id={self.node_id!r}, redis_url={url!r}, state={self._state!r})"

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError, ClosedError):
            return False

    def leads(self) -> list[int]:
        """The shards this node leads now."""
        node = self._run.node
        return node.leads() if node is not None else []

    def running_keys(self) -> list[str]:
        """The keys whose refreshes this node runs now (or has claimed and waits for a
        slot of their rule to run); empty for a coalescer that is not a worker."""
        node = self._run.node
        return node.runner.running_keys() if node is not None else []

    def stop_now(self) -> None:
        """Make ``close()`` (under way, or the next one) stop waiting for the running
        refreshes: they are cancelled at once instead of after ``grace``, and their keys
        run again once their claim lease expires, as after a crash. Nothing for a
        coalescer that is not a worker."""
        node = self._run.node
        if node is not None:
            node.runner.stop_now()

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Coalescer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            await self.close()
        except UnwrittenTouchesError:
            if exc is None:
                raise
            # the body's own error goes on; the unwritten keys were logged by close()

    async def start(self) -> None:
        self.after_fork()
        if self._state not in ("new", "forked"):
            raise ClosedError(f"start(): the coalescer is already {self._state}")
        self._state = "starting"
        run = self._run
        conn = await self._connect(run)
        await self._check_policy(run, conn)
        leases = await conn.leases() if self.worker else None
        run.scripts = scripts = Scripts(conn.client, self.config.durability, leases=leases)
        scripts.replication.listen(run.metrics.durability_unmet.set)
        if self.worker:
            await scripts.preload()
        run.layouts = Layouts(scripts, self.config.namespace, self.config.shards)
        await self._read_layout(run.layouts)
        run.flusher = Flusher(run.absorber, scripts, run.layouts, run.metrics)
        run.flusher.traces = self._traces = touch_traces()
        self._record = self._traces.record if self._traces is not None else None
        run.spawn("flusher", run.flusher.run())
        run.spawn("metrics", self._metrics_loop(run))
        run.quota = Quota(self.config, scripts, lambda: self.keyspace, run.metrics,
                          lambda: run.absorber.touches)
        run.spawn("limits", run.quota.run())
        assert run.policy is not None
        run.spawn("maxmemory-policy", run.policy.run())
        if run.embedded is not None:
            run.spawn("embedded server watch", embedded_watch.follow(run.embedded, conn))
        if self.worker:
            self._start_worker(run)
        self._state = "running"
        where = f" (embedded server at {run.embedded.root})" if run.embedded else ""
        log.info("coalescer %s started on %s%s (worker=%s, %s)", self.node_id,
                 redact(self.redis_url or ""), where, self.worker,
                 plural(self.keyspace.shards, "shard"))

    async def _read_layout(self, layouts: Layouts) -> None:
        """Read the namespace's layout; a worker node whose rules file names another
        shard count begins a reshard to it (see store/layout.py). Without Redis the
        writes find the layout themselves once it answers."""
        try:
            info = await layouts.refresh()
            if self.worker and info.shards != self.config.shards:
                await begin_reshard(layouts, self.config.shards, self.node_id)
        except (RedisError, OSError) as exc:
            log.warning("coalescer %s: could not read the shard layout yet: %r",
                        self.node_id, exc)

    async def _connect(self, run: Run) -> Connection:
        choice = (RootChoice(self._embedded_root, "the folder this coalescer was given")
                  if self._embedded_root else None)
        if choice is None and not self._redis_url and not os.environ.get(ENV_REDIS_URL):
            try:
                choice = find_root(self.config.source)
            except CoalescerError:  # no folder can be trusted with it: nothing to undo
                self._state = "closed"
                raise
        try:
            self._check_env_url()
            url, run.embedded = resolve_redis_url(self._redis_url,
                                                  choice.root if choice else None)
            if run.embedded is not None and choice is not None:
                run.embedded.reason = choice.reason
            async with self._explained(url):
                run.conn = await connect(url)
        except BaseException:
            run.release_embedded()
            self._state = "closed"
            raise
        return run.conn

    def _check_env_url(self) -> None:
        """RedisUrlError for an unusable $COALESCER_REDIS_URL that this coalescer uses."""
        from_env = os.environ.get(ENV_REDIS_URL)
        if not self._redis_url and from_env:
            check_url(from_env, "$" + ENV_REDIS_URL)

    def _explained(self, url: str | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Raise redis-py's connection and password errors as coalescer's own, naming the
        server (``url``, else the one in use) and what to check (store/redis_failures.py)."""
        run = self._run
        url = url or (run.conn.url if run.conn is not None else None)
        embedded = run.embedded is not None
        origin = "" if embedded or self._redis_url else "$" + ENV_REDIS_URL
        return explained(None if embedded else url, origin)

    async def _check_policy(self, run: Run, conn: Connection) -> None:
        """Refuse to start on a server whose maxmemory-policy may evict our keys."""
        try:
            policies = await check_at_start(conn.client, refuse=self._refuse_evicting)
        except BaseException:
            await run.close_resources()
            self._state = "closed"
            raise
        run.policy = PolicyWatch(conn.client, run.metrics, policies)

    def health_problems(self) -> list[str]:
        """What makes /healthz answer 503 apart from reachability and the age of the
        oldest unwritten touch: Redis refusing writes (with its reply), a
        maxmemory-policy that may evict coalescer's keys, ``durability`` unmet (too few
        replicas acknowledge writes) and a source that cannot read (a Kafka broker
        down)."""
        run = self._run
        found = [run.absorber.refused_by,
                 run.policy.reason if run.policy is not None else None,
                 run.scripts.replication.reason if run.scripts is not None else None]
        found += [problem for source in run.sources for problem in source.problems()]
        return [problem for problem in found if problem]

    def _start_worker(self, run: Run) -> None:
        assert run.conn is not None
        run.handlers = Handlers(self.config)
        run.node = Node(self._context(), invokers=run.handlers.invokers,
                        pubsub=run.conn.pubsub_client)
        run.node.start(run.spawn)
        if self.config.sources:
            self._start_sources(run)

    def _start_sources(self, run: Run) -> None:
        # In the façade, not the node: the worker layer never imports the sources.
        run.sources = start_sources(self._source_context(run))

    def _source_context(self, run: Run) -> SourceContext:
        assert run.conn is not None
        return SourceContext(
            config=self.config, conn=run.conn, node_id=self.node_id, touch_many=self.touch_many,
            flush=self.flush, metrics=run.metrics, touch_items=self.touch_items,
            touch_timed=self._touch_timed,
            trace_links=self._trace_links if self._traces is not None else None)

    def _record_all(self, keys: list[str]) -> None:
        """With tracing on, record the current span's context with each of ``keys``."""
        if self._record is not None:
            for key in keys:
                self._record(key)

    def link_trace(self, keys: Iterable[str], traceparent: str) -> None:
        """With tracing on, record a producer's trace context (a W3C traceparent string,
        e.g. an HTTP request's header) with ``keys`` just touched: their refreshes link
        to it. Nothing with tracing off; a context that does not read is ignored."""
        if self._traces is not None:
            for key in keys:
                self._traces.record_remote(key, traceparent)

    def _trace_links(self, pairs: list[tuple[str, str]]) -> None:
        """Record each (key, producer's W3C traceparent) a source read, for the key's
        refresh to link to (tracing on)."""
        if self._traces is not None:
            for key, traceparent in pairs:
                self._traces.record_remote(key, traceparent)

    def _touch_timed(self, touches: list[tuple[str, str | None, str]]) -> None:
        """Touch each (key, item or None, time in its wire form: config/schedule.py),
        all or none: what a source's ``at:``/``delay:`` gives (sources/times.py)."""
        if self._state != "running":
            raise self._not_running("touch (from a source)")
        self._check_quota()
        self._run.absorber.touch_timed(touches)

    async def _metrics_loop(self, run: Run) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sync_metrics()
            run.metrics.buffered.set(len(run.absorber))
            if self._traces is not None:
                self._traces.sweep()
            if run.node is not None:
                run.node.tick()

    async def close(self, *, flush_timeout: float = CLOSE_FLUSH_TIMEOUT) -> None:
        """Stop taking work, flush, drain refreshes up to ``grace``, release leases.

        The buffered touches are written for up to ``flush_timeout`` seconds (retried
        while Redis is unreachable or refuses writes); if some could not be, everything
        is still closed and released, then UnwrittenTouchesError is raised with their
        ``keys`` and ``count``. Idempotent: a second call waits for the first to finish.
        """
        if self._state in ("closing", "closed"):
            await self._closed.wait()
            return
        if self._state in ("new", "forked"):
            self._state = "closed"
            self._closed.set()
            return
        self._state = "closing"
        try:
            unwritten = await self._shutdown(self._run, flush_timeout)
        finally:
            self._state = "closed"
            self._closed.set()
        if unwritten is not None:
            raise unwritten

    async def _shutdown(self, run: Run, flush_timeout: float) -> UnwrittenTouchesError | None:
        run.absorber.close_waits()  # touches waiting for room end: no new ones come in
        await self._quietly("stop sources", run.stop_sources())
        if run.node is not None:
            run.node.stop_claiming()
        failure = await self._final_flush(run, flush_timeout)
        if run.node is not None:
            await self._quietly("release leases", run.node.release())
            await run.node.finish(self.grace)
        await run.stop_tasks()
        unwritten = await self._unwritten(run, failure)
        await run.close_resources()
        log.info("coalescer %s closed", self.node_id)
        return unwritten

    async def _final_flush(self, run: Run, timeout: float) -> str | None:
        """Write the buffered touches, trying again until ``timeout``; None once
        written, else why not."""
        assert run.flusher is not None
        deadline = time.monotonic() + timeout
        why = "the flush timed out"
        while True:
            try:
                await asyncio.wait_for(run.flusher.flush(), max(0.0, deadline - time.monotonic()))
                self.sync_metrics()
                return None
            except CoalescerError as exc:  # RedisWriteError, or a layout that kept moving
                why = str(exc)
            except TimeoutError:
                if run.flusher.last_failure is not None:
                    why = f"the flush timed out; {run.flusher.last_failure}"
            if time.monotonic() >= deadline:
                log.warning("shutdown: flush failed: %s", why)
                return why
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _unwritten(self, run: Run, failure: str | None) -> UnwrittenTouchesError | None:
        """The error close() raises for the touches left unwritten, if any."""
        assert run.flusher is not None
        await run.flusher.settle()
        keys = run.absorber.unwritten_keys()
        if not keys:
            return None
        error = UnwrittenTouchesError(keys, failure or "the flush did not end")
        log.error("shutdown: %s", error)
        return error

    async def _quietly(self, what: str, aw: Any, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(aw, timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("shutdown: %s failed: %r", what, exc)

    def _not_running(self, what: str) -> ClosedError:
        if self._state == "forked":
            return ClosedError(
                f"{what}: this coalescer was started in process {self._forked_from}, of "
                f"which process {self._pid} is a fork; await start() again here (it "
                "connects anew, with an empty buffer)")
        if self._state == "new":
            return ClosedError(f"{what}: the coalescer is not started; await start() "
                               "first, or use it as 'async with'")
        return ClosedError(f"{what}: the coalescer is {self._state}, not running")

    def after_fork(self) -> None:
        """In a forked child (no-op elsewhere): park, never close, the parent's run (its
        loop objects, connections and buffered touches: the parent writes those) and
        start over with a fresh one, under a node id of its own unless one was given;
        a started coalescer must be started again.
        """
        if self._pid == os.getpid():
            return
        parent, state = self._pid, self._state
        self._pid = os.getpid()
        if state == "closed":
            return
        forksafe.park((self._run, self._closed))
        self._run = self._new_run()
        self._closed = asyncio.Event()
        self.node_id = self._given_node_id or default_node_id()  # the child's pid
        self._state = "new" if state == "new" else "forked"
        self._forked_from = None if state == "new" else parent
        log.debug("coalescer: process %d forked from %d, where it was %s", self._pid,
                  parent, state)
