"""``Lifecycle``: a coalescer's start (connection or embedded server, the
maxmemory-policy check, the scripts, the shard layout, the flusher and the background
tasks, a worker's node and sources) and its close (stop sources and claims, the final
flush, release leases, stop tasks, close connections), and what makes it unhealthy."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.errors import ClosedError, CoalescerError, UnwrittenTouchesError
from coalescer.facade.core import Core
from coalescer.facade.run import Run
from coalescer.sources.base import NodeContext as SourceContext
from coalescer.sources.base import start_sources
from coalescer.store import embedded_watch, protocol_version
from coalescer.store.connection import Connection, connect
from coalescer.store.embedded import ENV_REDIS_URL, RootChoice, find_root, resolve_redis_url
from coalescer.store.eviction import PolicyWatch, check_at_start
from coalescer.store.layout import Layouts
from coalescer.store.redis_failures import check_url
from coalescer.store.scripts import Scripts
from coalescer.tracing import touch_traces
from coalescer.worker.handlers import Handlers
from coalescer.worker.node import Node
from coalescer.worker.resharding import begin_reshard
from coalescer.write.flusher import Flusher
from coalescer.write.quota import Quota

log = logging.getLogger(__name__)


class Lifecycle:
    """The start and close of one coalescer (see ``Coalescer.start`` and ``close``)."""

    def __init__(self, core: Core, source_context: Callable[[Run], SourceContext]) -> None:
        self.core = core
        self.source_context = source_context

    async def start(self) -> None:
        core = self.core
        core.after_fork()
        if core._state not in ("new", "forked"):
            raise ClosedError(f"start(): the coalescer is already {core._state}")
        core._state = "starting"
        run = core._run
        conn = await self._connect(run)
        await self._check_policy(run, conn)
        await self._check_protocol(run, conn)
        leases = await conn.leases() if core.worker else None
        run.scripts = scripts = Scripts(conn.client, core.config.durability, leases=leases)
        scripts.replication.listen(run.metrics.durability_unmet.set)
        if core.worker:
            await scripts.preload()
        run.layouts = Layouts(scripts, core.config.namespace, core.config.shards)
        await self._read_layout(run.layouts)
        self._spawn_tasks(run, scripts, conn)
        if core.worker:
            self._start_worker(run)
        core._state = "running"
        where = f" (embedded server at {run.embedded.root})" if run.embedded else ""
        log.info("coalescer %s started on %s%s (worker=%s, %s)", core.node_id,
                 redact(core.redis_url or ""), where, core.worker,
                 plural(core.keyspace.shards, "shard"))

    def _spawn_tasks(self, run: Run, scripts: Scripts, conn: Connection) -> None:
        """The flusher, the metrics, the limits, the policy watch, the embedded server's."""
        core = self.core
        assert run.layouts is not None and run.policy is not None
        run.flusher = Flusher(run.absorber, scripts, run.layouts, run.metrics)
        run.flusher.traces = core._traces = touch_traces()
        core._record = core._traces.record if core._traces is not None else None
        run.spawn("flusher", run.flusher.run())
        run.spawn("metrics", self._metrics_loop(run))
        run.quota = Quota(core.config, scripts, lambda: core.keyspace, run.metrics,
                          lambda: run.absorber.touches)
        run.spawn("limits", run.quota.run())
        run.spawn("maxmemory-policy", run.policy.run())
        if run.embedded is not None:
            run.spawn("embedded server watch", embedded_watch.follow(run.embedded, conn))

    async def _read_layout(self, layouts: Layouts) -> None:
        """Read the namespace's layout; a worker node whose rules file names another
        shard count begins a reshard to it (see store/layout.py). Without Redis the
        writes find the layout themselves once it answers."""
        core = self.core
        try:
            info = await layouts.refresh()
            if core.worker and info.shards != core.config.shards:
                await begin_reshard(layouts, core.config.shards, core.node_id)
        except (RedisError, OSError) as exc:
            log.warning("coalescer %s: could not read the shard layout yet: %r",
                        core.node_id, exc)

    async def _connect(self, run: Run) -> Connection:
        core = self.core
        choice = (RootChoice(core._embedded_root, "the folder this coalescer was given")
                  if core._embedded_root else None)
        if choice is None and not core._redis_url and not os.environ.get(ENV_REDIS_URL):
            try:
                choice = find_root(core.config.source)
            except CoalescerError:  # no folder can be trusted with it: nothing to undo
                core._state = "closed"
                raise
        try:
            self._check_env_url()
            url, run.embedded = resolve_redis_url(core._redis_url,
                                                  choice.root if choice else None)
            if run.embedded is not None and choice is not None:
                run.embedded.reason = choice.reason
            async with core._explained(url):
                run.conn = await connect(url)
        except BaseException:
            run.release_embedded()
            core._state = "closed"
            raise
        return run.conn

    def _check_env_url(self) -> None:
        """RedisUrlError for an unusable $COALESCER_REDIS_URL that this coalescer uses."""
        from_env = os.environ.get(ENV_REDIS_URL)
        if not self.core._redis_url and from_env:
            check_url(from_env, "$" + ENV_REDIS_URL)

    async def _check_policy(self, run: Run, conn: Connection) -> None:
        """Refuse to start on a server whose maxmemory-policy may evict our keys."""
        try:
            policies = await check_at_start(conn.client, refuse=self.core._refuse_evicting)
        except BaseException:
            await run.close_resources()
            self.core._state = "closed"
            raise
        run.policy = PolicyWatch(conn.client, run.metrics, policies)

    async def _check_protocol(self, run: Run, conn: Connection) -> None:
        """Refuse to start on a namespace whose keys follow a touch protocol of another
        major version (store/protocol_version.py); without Redis, only warn."""
        namespace = self.core.config.namespace
        try:
            await protocol_version.check(conn.client, namespace)
        except (RedisError, OSError) as exc:
            log.warning("coalescer %s: could not read the touch protocol version of "
                        "namespace %r yet: %r", self.core.node_id, namespace, exc)
        except BaseException:
            await run.close_resources()
            self.core._state = "closed"
            raise

    def _start_worker(self, run: Run) -> None:
        core = self.core
        assert run.conn is not None
        run.handlers = Handlers(core.config)
        run.node = Node(core._context(), invokers=run.handlers.invokers,
                        pubsub=run.conn.pubsub_client)
        run.node.start(run.spawn)
        if core.config.sources:
            # In the façade, not the node: the worker layer never imports the sources.
            run.sources = start_sources(self.source_context(run))

    async def _metrics_loop(self, run: Run) -> None:
        core = self.core
        while True:
            await asyncio.sleep(1.0)
            core.sync_metrics()
            run.metrics.buffered.set(len(run.absorber))
            if core._traces is not None:
                core._traces.sweep()
            if run.node is not None:
                run.node.tick()

    def health_problems(self) -> list[str]:
        run = self.core._run
        found = [run.absorber.refused_by,
                 run.policy.reason if run.policy is not None else None,
                 run.scripts.replication.reason if run.scripts is not None else None]
        found += [problem for source in run.sources for problem in source.problems()]
        return [problem for problem in found if problem]

    async def close(self, flush_timeout: float) -> None:
        core = self.core
        if core._state in ("closing", "closed"):
            await core._closed.wait()
            return
        if core._state in ("new", "forked"):
            core._state = "closed"
            core._closed.set()
            return
        core._state = "closing"
        try:
            unwritten = await self._shutdown(core._run, flush_timeout)
        finally:
            core._state = "closed"
            core._closed.set()
        if unwritten is not None:
            raise unwritten

    async def _shutdown(self, run: Run, flush_timeout: float) -> UnwrittenTouchesError | None:
        run.absorber.close_waits()  # touches waiting for room end: no new ones come in
        await _quietly("stop sources", run.stop_sources())
        if run.node is not None:
            run.node.stop_claiming()
        failure = await self._final_flush(run, flush_timeout)
        if run.node is not None:
            await _quietly("release leases", run.node.release())
            await run.node.finish(self.core.grace)
        await run.stop_tasks()
        unwritten = await _unwritten(run, failure)
        await run.close_resources()
        log.info("coalescer %s closed", self.core.node_id)
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
                self.core.sync_metrics()
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


async def _unwritten(run: Run, failure: str | None) -> UnwrittenTouchesError | None:
    """The error close() raises for the touches left unwritten, if any."""
    assert run.flusher is not None
    await run.flusher.settle()
    keys = run.absorber.unwritten_keys()
    if not keys:
        return None
    error = UnwrittenTouchesError(keys, failure or "the flush did not end")
    log.error("shutdown: %s", error)
    return error


async def _quietly(what: str, aw: Awaitable[Any], timeout: float = 10.0) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("shutdown: %s failed: %r", what, exc)
