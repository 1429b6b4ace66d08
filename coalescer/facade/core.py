"""``Core``: what every part of a coalescer shares: its options, its state (new,
starting, running, closing, closed, forked), the run it owns now, and the few checks
and reads every part makes of them (is it running, the quota, the key space, the
connection, a flush). ``Coalescer`` is a ``Core`` that delegates to its parts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coalescer.common import forksafe
from coalescer.common.audit_log import AuditSink
from coalescer.config.rules import Config
from coalescer.errors import ClosedError, ConfigError
from coalescer.facade.run import Run
from coalescer.sources.base import check_sources
from coalescer.store.audit_stream import AuditStream, Unwritable
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.store.hints import CommandHints
from coalescer.store.keys import KeySpace
from coalescer.store.redis_failures import check_url, explained
from coalescer.store.scripts import Scripts
from coalescer.worker.context import NodeContext
from coalescer.worker.lease_clock import ServerClock
from coalescer.write.absorber import Absorber

if TYPE_CHECKING:
    from coalescer.tracing.touches import TouchTraces

log = logging.getLogger(__name__)


def default_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def refuse_sources_that_cannot_run(config: Config) -> None:
    """A worker does not start with a source it could not run (its database's driver
    not installed, an environment variable of its URL not set): ConfigError naming
    the file, line and field of each."""
    problems = check_sources(config, os.environ) if config.sources else []
    if problems:
        raise ConfigError.combine(problems)


class Core:
    """A coalescer's options and state, shared by its parts."""

    def __init__(self, config: Config, *, redis_url: str | None, worker: bool,  # noqa: PLR0913
                 node_id: str | None, max_buffered: int, grace: float,
                 embedded_root: Path | None, refuse_evicting_policy: bool) -> None:
        self.config = config.with_handlers() if worker else config  # only workers call them
        if worker:
            refuse_sources_that_cannot_run(self.config)
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
        self._state = "new"
        self._closed = asyncio.Event()
        self._pid = os.getpid()
        self._forked_from: int | None = None
        forksafe.track(self)
        self.hints = CommandHints.of(config.source, redis_url)
        """The options a printed `coalescer` command needs to reach these rules and server."""

    def _new_run(self) -> Run:
        run = Run(Absorber(self.config.rule_for, max_keys=self._max_buffered))
        self._absorber = run.absorber  # the run's, held here too: touch() is the hot path
        return run

    def _running(self, what: str) -> Run:
        """The run, when the coalescer is running; else the ClosedError saying why not."""
        if self._state != "running":
            raise self._not_running(what)
        return self._run

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

    def _check_quota(self) -> None:
        """QuotaExceededError when the pending keys reached ``limits.pending_keys``."""
        quota = self._run.quota
        if quota is not None:
            quota.check()

    @property
    def keyspace(self) -> KeySpace:
        """How keys map to shards now: the namespace's layout in Redis (read at start,
        and again when it changes), or the rules file's count before the first read."""
        layouts = self._run.layouts
        return layouts.keyspace if layouts is not None else self._keyspace

    @property
    def redis(self) -> Any:
        if self._run.conn is None:
            raise ClosedError("the coalescer is not connected")
        return self._run.conn.client

    @property
    def redis_url(self) -> str | None:
        """The URL in use (with its password: show ``redact(redis_url)``, never this)."""
        conn = self._run.conn
        return conn.url if conn else self._redis_url

    @property
    def audit(self) -> AuditSink:
        """Where operator actions are written (the namespace's audit log): pass it as
        ``operator_action(..., sink=c.audit)``. Not connected, a sink whose every entry
        is counted as not written (an action must never fail for its entry)."""
        run = self._run
        if run.audit is None:
            if run.conn is None:
                return Unwritable(f"the coalescer is {self._state}, not connected")
            run.audit = AuditStream(run.conn.client, self.config.namespace)
        return run.audit

    def _connected(self) -> tuple[Any, Scripts]:
        client = self.redis
        assert self._run.scripts is not None
        return client, self._run.scripts

    def _context(self) -> NodeContext:
        run = self._run
        assert run.scripts is not None and run.layouts is not None and run.conn is not None
        return NodeContext(scripts=run.scripts, keyspace=self.keyspace, layouts=run.layouts,
                           metrics=run.metrics,
                           node_id=self.node_id, config=self.config, hints=self.hints,
                           clock=None if run.conn.cluster else ServerClock())

    def _explained(self, url: str | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Raise redis-py's connection and password errors as coalescer's own, naming the
        server (``url``, else the one in use) and what to check (store/redis_failures.py)."""
        run = self._run
        url = url or (run.conn.url if run.conn is not None else None)
        embedded = run.embedded is not None
        origin = "" if embedded or self._redis_url else "$" + ENV_REDIS_URL
        return explained(None if embedded else url, origin)

    async def flush(self) -> None:
        """Return once Redis holds the due time of every touch made before this call."""
        self.after_fork()
        if self._run.flusher is None:
            raise self._not_running("flush()")
        async with self._explained():  # RedisConnectError says what to check
            await self._run.flusher.flush()
        self.sync_metrics()

    def sync_metrics(self) -> None:
        """Bring the touch counters of ``metrics`` up to date (they sync every second)."""
        self._run.sync_metrics()

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
