"""``Coalescer``: the façade a user holds. It owns the state its parts share
(``facade/core.py``) and delegates each job to one part: touching
(``facade/touching.py``), cancelling (``facade/cancelling.py``), draining
(``facade/draining.py``), a node's start and close (``facade/lifecycle.py``); reads
go through ``query`` (``query/reader.py``).

What one start creates (the connection, the flusher, the worker node, the
background tasks, the touch buffer) lives in one ``Run`` (``facade/run.py``); a forked
child parks its parent's run whole, never closing it, and starts over with a fresh one.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from redis.exceptions import RedisError

from coalescer.claim import Claim
from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.config.code_rules import Rules, rules_config
from coalescer.config.priority import Priority
from coalescer.config.rules import Config
from coalescer.config.schedule import At, Delay
from coalescer.errors import ClosedError, UnwrittenTouchesError
from coalescer.facade.cancelling import Cancelling
from coalescer.facade.core import Core
from coalescer.facade.draining import Draining
from coalescer.facade.lifecycle import Lifecycle
from coalescer.facade.run import Run
from coalescer.facade.touching import Touching
from coalescer.query.reader import Query
from coalescer.sources.base import NodeContext as SourceContext
from coalescer.write.cancel import CancelOutcome
from coalescer.write.room import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED = 100_000
CLOSE_FLUSH_TIMEOUT = 10.0  # seconds close() keeps trying to write the buffered touches


def _the_rules(config: Config | Rules | None, rules: Config | Rules | None) -> Config:
    """The Config given either way (positionally, or as ``rules=``); exactly one."""
    if config is not None and rules is None:
        return rules_config(config)
    if rules is not None and config is None:
        return rules_config(rules)
    raise TypeError("give the rules once: Coalescer(config) (e.g. Config.from_yaml(path)) "
                    "or Coalescer(rules=Rules(...))")


class Coalescer(Core):
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
        super().__init__(_the_rules(config, rules), redis_url=redis_url, worker=worker,
                         node_id=node_id, max_buffered=max_buffered, grace=grace,
                         embedded_root=embedded_root,
                         refuse_evicting_policy=refuse_evicting_policy)
        self._query = Query(lambda: self.config, self._connected, self._explained)
        self._touching = Touching(self)
        self._cancelling = Cancelling(self)
        self._draining = Draining(self, self._source_context)
        self._lifecycle = Lifecycle(self, self._source_context)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **options: Any) -> Coalescer:
        """Load and validate ``path``, then build a coalescer on it. Handler
        modules are imported only with ``worker=True``: a writer never calls them."""
        worker = options.get("worker", True)
        return cls(Config.from_yaml(path, import_handlers=worker), **options)

    # -- touching (facade/touching.py) -----------------------------------------------

    def touch(self, key: str, item: str | None = None, *, at: At | None = None,
              delay: Delay | None = None, keep_items: bool = False,
              priority: Priority | None = None) -> None:
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
        ``priority`` (seconds, a timedelta or "30s"; the rule must be fair or have a
        ``priority:``): among due keys, the key is claimed as if due that much earlier,
        never before its due time; its burst keeps the largest priority its touches gave.
        A bad one raises InvalidPriorityError.

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
        self._touching.touch(key, item, at, delay, keep_items, priority=priority)

    def touch_items(self, pairs: Iterable[tuple[str, str]], *, keys: Iterable[str] = (),
                    at: At | None = None, delay: Delay | None = None,
                    keep_items: bool = False, priority: Priority | None = None) -> None:
        """Touch each key of the ``(key, item)`` pairs with its item, and each of ``keys``
        plainly: every one or none (UnknownKeyError, InvalidKeyError, InvalidItemError,
        InvalidScheduleError, BackpressureError, ClosedError). ``at``/``delay``,
        ``keep_items``: the time of every one of them (see ``touch``)."""
        self._touching.touch_items(pairs, keys, at, delay, keep_items, priority=priority)

    def touch_many(self, keys: Iterable[str], *, at: At | None = None,
                   delay: Delay | None = None, keep_items: bool = False,
                   priority: Priority | None = None) -> None:
        """Touch every key or none (UnknownKeyError, InvalidKeyError, InvalidScheduleError,
        BackpressureError, ClosedError). ``at``/``delay``, ``keep_items``: the time of
        every one of them (see ``touch``); checked, with every key, before any is buffered."""
        self._touching.touch_many(keys, at, delay, keep_items, priority)

    async def touch_wait(self, key: str, item: str | None = None, *,
                         timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                         delay: Delay | None = None) -> None:
        """``touch(key)`` that waits while the buffer is full, for bulk writers.

        Returns once the touch is buffered, as ``touch`` does; while the buffer is
        full it waits (without blocking the event loop) until the flusher has written
        keys to Redis, for at most ``timeout`` seconds (None: no bound), then raises
        BackpressureError. The other errors are ``touch``'s.
        """
        await self._touching.touch_wait(key, item, timeout, at, delay)

    async def touch_many_wait(self, keys: Iterable[str], *,
                              timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                              delay: Delay | None = None) -> None:
        """Touch every key, waiting while the buffer is full (see ``touch_wait``).

        Every key is checked first: one that is refused (UnknownKeyError,
        InvalidKeyError) touches nothing. Keys are buffered in order as room frees,
        so any number of keys fit; on timeout, BackpressureError says how many were
        buffered (those are written, the rest are not touched).
        """
        await self._touching.wait_for_room("touch_many_wait()", keys, (), timeout, at=at,
                                           delay=delay)

    async def touch_items_wait(self, pairs: Iterable[tuple[str, str]], *,
                               timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                               delay: Delay | None = None) -> None:
        """``touch_items`` that waits while the buffer is full, as ``touch_many_wait``
        does (every pair is checked first; on timeout, BackpressureError says how many
        went in)."""
        await self._touching.wait_for_room("touch_items_wait()", (), pairs, timeout, at=at,
                                           delay=delay)

    def touch_blocking(self, keys: Iterable[str], *, timeout: float | None = DEFAULT_TIMEOUT,
                       what: str = "touch_blocking()",
                       pairs: Iterable[tuple[str, str]] = (), at: At | None = None,
                       delay: Delay | None = None) -> None:
        """``touch_many_wait`` for a thread that is not running an event loop: blocks
        it while the buffer is full (``SyncCoalescer``'s waiting touches are this)."""
        self._touching.block_for_room(what, keys, pairs, timeout, at=at, delay=delay)

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` that no rule matches (nothing is touched)."""
        return self._touching.unknown_keys(keys)

    def refused_items(self, pairs: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
        """The (key, item) touches of ``pairs`` that would be refused for their item or
        key (not UTF-8, NUL, too long, empty, a rule without items), each as ``{"index",
        "key", "item", "error"}`` (a key no rule matches is ``unknown_keys``'s)."""
        return self._touching.refused_items(pairs)

    def link_trace(self, keys: Iterable[str], traceparent: str) -> None:
        """With tracing on, record a producer's trace context (a W3C traceparent string,
        e.g. an HTTP request's header) with ``keys`` just touched: their refreshes link
        to it. Nothing with tracing off; a context that does not read is ignored."""
        self._touching.trace_links([(key, traceparent) for key in keys])

    # -- cancelling (facade/cancelling.py) -------------------------------------------

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
        return await self._cancelling.cancel_many(keys)

    async def cancel_scheduled(self, rule: str, *, after: At, dry_run: bool = False,
                               who: str | None = None) -> int:
        """Cancel every pending key of ``rule`` whose own time (``at``/``delay``) is
        after ``after``, a page at a time (write/cancel_scheduled.py); how many (only
        counted with ``dry_run``). Logged at INFO with ``who`` (default: the local
        user). KeyError for an unknown rule, InvalidScheduleError for a bad time."""
        return await self._cancelling.cancel_scheduled(rule, after, dry_run, who)

    # -- draining (facade/draining.py) -----------------------------------------------

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
        return await self._draining.drain(timeout, sources)

    def _source_context(self, run: Run) -> SourceContext:
        assert run.conn is not None
        touching = self._touching
        return SourceContext(
            config=self.config, conn=run.conn, node_id=self.node_id, touch_many=self.touch_many,
            flush=self.flush, metrics=run.metrics, touch_items=self.touch_items,
            touch_timed=touching.touch_timed,
            trace_links=touching.trace_links if self._traces is not None else None)

    # -- reads -----------------------------------------------------------------------

    @property
    def metrics(self) -> Metrics:
        """This coalescer's metrics (``metrics.registry`` is what /metrics serves)."""
        return self._run.metrics

    def unwritten_age(self) -> float | None:
        """Seconds since the oldest touch not yet in Redis was made; None if there is none."""
        since = self._run.absorber.oldest_unwritten()
        return None if since is None else time.monotonic() - since

    def dropped_keys(self) -> list[dict[str, Any]]:
        """The last keys dropped because Redis refused them for good, oldest first."""
        flusher = self._run.flusher
        return [d.as_json() for d in flusher.dropped] if flusher else []

    @property
    def query(self) -> Query:
        """Reads and dead-letter operations: ``status()``, ``explain(key)``,
        ``history()``, ``next_due()``, ``dead_letters()``, ``retry_dead()``,
        ``purge_dead()`` (ClosedError while not connected)."""
        return self._query

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

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError, ClosedError):
            return False

    def health_problems(self) -> list[str]:
        """What makes /healthz answer 503 apart from reachability and the age of the
        oldest unwritten touch: Redis refusing writes (with its reply), a
        maxmemory-policy that may evict coalescer's keys, ``durability`` unmet (too few
        replicas acknowledge writes) and a source that cannot read (a Kafka broker
        down)."""
        return self._lifecycle.health_problems()

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

    # -- lifecycle (facade/lifecycle.py) ---------------------------------------------

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
        await self._lifecycle.start()

    async def close(self, *, flush_timeout: float = CLOSE_FLUSH_TIMEOUT) -> None:
        """Stop taking work, flush, drain refreshes up to ``grace``, release leases.

        The buffered touches are written for up to ``flush_timeout`` seconds (retried
        while Redis is unreachable or refuses writes); if some could not be, everything
        is still closed and released, then UnwrittenTouchesError is raised with their
        ``keys`` and ``count``. Idempotent: a second call waits for the first to finish.
        """
        await self._lifecycle.close(flush_timeout)

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
