"""``Coalescer``: the lifecycle that ties touch, flush, election, polling and refresh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from redis.exceptions import RedisError

from coalescer.claim import Claim
from coalescer.common import forksafe
from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.config.rules import Config, HttpHandler
from coalescer.errors import ClosedError, UnknownKeyError
from coalescer.query.dead_letters import (
    Action,
    DeadOutcome,
    DeadPage,
    act_on_all,
    act_on_keys,
    list_dead,
    look_up_dead,
    requeue_dead,
)
from coalescer.query.due import DEFAULT_SHOWN, next_due
from coalescer.query.explain import gather_explain
from coalescer.query.history import HistoryQuery, Refresh, read_history
from coalescer.query.status import gather_status
from coalescer.sources.base import NodeContext, Source, start_sources, stop_sources
from coalescer.store.connection import Connection, connect
from coalescer.store.embedded import EmbeddedServer, project_root, resolve_redis_url
from coalescer.store.hints import CommandHints
from coalescer.store.keys import KeySpace
from coalescer.store.scripts import History, Scripts
from coalescer.worker.adopter import Adopter
from coalescer.worker.drain import Drainer, local_runner
from coalescer.worker.invoke import Invoke, invoker_for
from coalescer.worker.lead_log import LeadLog
from coalescer.worker.leadership import Leadership
from coalescer.worker.poller import Poller
from coalescer.worker.registry import RegistryWatch, encode
from coalescer.worker.runner import Runner
from coalescer.worker.wakeups import WakeListener
from coalescer.write.absorber import Absorber
from coalescer.write.flusher import Flusher

log = logging.getLogger(__name__)

DEFAULT_MAX_BUFFERED = 100_000


def default_node_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Coalescer:
    """Debounce and coalesce refreshes, across every process and node, on Redis.

    ``touch(key)`` is sync and cheap; ``await flush()`` returns once Redis holds
    every earlier touch. With ``worker=True`` this process also joins the leader
    election and runs refresh handlers. Use as ``async with``.

    In a process forked from one where it was started, it stops with a ClosedError
    saying so until ``start()`` is awaited again there (the parent's connections and
    buffered touches stay the parent's); one created but not started is simply
    started in the child.
    """

    def __init__(self, config: Config, *, redis_url: str | None = None, worker: bool = True,
                 node_id: str | None = None, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 grace: float = 30.0, embedded_root: Path | None = None) -> None:
        self.config = config.with_handlers() if worker else config  # only workers call them
        self.worker = worker
        self.node_id = node_id or default_node_id()
        self.grace = grace
        self.metrics = Metrics()
        self.keyspace = KeySpace(config.namespace, config.shards)
        self.webhooks: Any = None
        self._redis_url = redis_url
        self._embedded_root = embedded_root
        self._embedded: EmbeddedServer | None = None
        self._absorber = Absorber(config.rule_for, max_keys=max_buffered)
        self._conn: Connection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._leaderships: list[Leadership] = []
        self._runner: Runner | None = None
        self._flusher: Flusher | None = None
        self._sources: list[Source] = []
        self._executor: ThreadPoolExecutor | None = None
        self._drain_invokers: dict[str, Invoke] | None = None
        self._state = "new"
        self._closed = asyncio.Event()
        self._seen: tuple[int, int] = (0, 0)
        self._led: set[int] = set()
        self._args: dict[str, Any] = {
            "redis_url": redis_url, "worker": worker, "node_id": node_id,
            "max_buffered": max_buffered, "grace": grace, "embedded_root": embedded_root}
        self._pid = os.getpid()
        self._forked_from: int | None = None
        forksafe.track(self)
        self._lead_log = LeadLog(self.node_id, config.shards, self._led)
        self.hints = CommandHints.of(config.source, redis_url)
        """The options a printed `coalescer` command needs to reach these rules and server."""

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **options: Any) -> Coalescer:
        """Load and validate ``path``, then build a coalescer on it. Handler
        modules are imported only with ``worker=True``: a writer never calls them."""
        worker = options.get("worker", True)
        return cls(Config.from_yaml(path, import_handlers=worker), **options)


    # -- the write path --------------------------------------------------------------

    def touch(self, key: str) -> None:
        """Mark ``key`` stale: its rule's handler runs once, a quiet window later.

        Sync, non-blocking, safe from any thread. Raises UnknownKeyError for a key
        no rule matches, InvalidKeyError for one Redis cannot store (not UTF-8, a
        NUL character, over 1024 bytes), BackpressureError when the buffer is full,
        ClosedError when the coalescer is not running.
        """
        if self._state != "running":
            raise self._not_running(f"touch({key!r})")
        self._absorber.touch(key)

    def touch_many(self, keys: Iterable[str]) -> None:
        """Touch every key or none (UnknownKeyError, InvalidKeyError, BackpressureError,
        ClosedError)."""
        if self._state != "running":
            raise self._not_running("touch_many()")
        self._absorber.touch_many(list(keys))

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        """The keys of ``keys`` that no rule matches (nothing is touched)."""
        out = []
        for key in keys:
            try:
                self.config.rule_for(key)
            except UnknownKeyError:
                out.append(key)
        return out

    async def flush(self) -> None:
        """Return once Redis holds the due time of every touch made before this call."""
        self.after_fork()
        if self._flusher is None:
            raise self._not_running("flush()")
        await self._flusher.flush()
        self.sync_metrics()

    def sync_metrics(self) -> None:
        """Bring the touch counters of ``metrics`` up to date (they sync every second)."""
        a, m = self._absorber, self.metrics
        touches, absorbed = a.touches, a.absorbed
        m.touches.inc(touches - self._seen[0])
        m.absorbed.inc(absorbed - self._seen[1])
        self._seen = (touches, absorbed)

    def unwritten_age(self) -> float | None:
        """Seconds since the oldest touch not yet in Redis was made; None if there is none."""
        since = self._absorber.oldest_unwritten()
        return None if since is None else time.monotonic() - since

    def dropped_keys(self) -> list[dict[str, Any]]:
        """The last keys dropped because Redis refused them for good, oldest first."""
        return [d.as_json() for d in self._flusher.dropped] if self._flusher else []

    async def drain(self, timeout: float = 30.0) -> list[Claim]:
        """Run everything pending now through this process's handlers, windows and
        retry backoff skipped, and return the claims run, in the order they started.

        Meant for tests. Flushes this process's touches first; drains touches that
        the handlers make through this coalescer too, until nothing of its rules is
        pending or in flight in Redis. Works with ``worker=False`` as well: the
        handlers then run here for the drain's length. Claims are taken as a leader
        takes them (fencing tokens, leases), whichever node leads; what another
        node runs meanwhile is waited for but not returned. A failing handler is
        retried at once until its attempts run out (dead-lettered, in the list once
        per attempt). Raises TimeoutError naming the keys left after ``timeout``.
        """
        if self._state != "running":
            raise self._not_running("drain()")
        if self._runner is not None:
            return await self._drainer(self._runner).run(timeout)
        if self._drain_invokers is None:
            self._drain_invokers = self._invokers()
        async with local_runner(scripts=self._scripts, keyspace=self.keyspace,
                                metrics=self.metrics, invokers=self._drain_invokers,
                                config=self.config, node_id=self.node_id,
                                hints=self.hints) as runner:
            return await self._drainer(runner).run(timeout)

    def _drainer(self, runner: Runner) -> Drainer:
        return Drainer(config=self.config, keyspace=self.keyspace, scripts=self._scripts,
                       runner=runner, node_id=self.node_id, flush=self.flush, redis=self.redis)

    # -- reading -----------------------------------------------------------------------

    @property
    def redis(self) -> Any:
        if self._conn is None:
            raise ClosedError("the coalescer is not connected")
        return self._conn.client

    @property
    def redis_url(self) -> str | None:
        """The URL in use (with its password: show ``redact(redis_url)``, never this)."""
        return self._conn.url if self._conn else self._redis_url

    @property
    def embedded_root(self) -> Path | None:
        """The folder of the embedded server, while this coalescer runs on it."""
        return self._embedded.root if self._embedded is not None else None

    def __repr__(self) -> str:
        url = redact(self.redis_url) if self.redis_url else None
        return f"Coalescer(node_id={self.node_id!r}, redis_url={url!r}, state={self._state!r})"

    async def status(self) -> dict[str, Any]:
        """The JSON of ``coalescer status --json``."""
        return await gather_status(self.redis, self.config)

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError, ClosedError):
            return False

    async def retry_dead(self, keys: Iterable[str] | None = None) -> int:
        """Re-queue dead-lettered ``keys`` (all of them when None); returns how many."""
        if self._conn is None:
            raise ClosedError("retry_dead(): the coalescer is not running")
        return await requeue_dead(self._conn.client, self._scripts, self.config, keys)

    async def explain(self, key: str) -> dict[str, Any]:
        """Where ``key`` stands and why (the JSON of ``coalescer explain KEY --json``).

        Its rule and settings; its state (idle, pending with its due time and
        whether the window or the max wait set it, backoff with the last error,
        running with node, token and lease left, or dead with its error); its
        burst's first and last touch; attempts; its last refreshes from the
        history. Raises UnknownKeyError when no rule matches ``key``.
        """
        return await gather_explain(self.redis, self.config, key)

    async def history(self, query: HistoryQuery | None = None) -> list[Refresh]:
        """Recent refreshes, newest first, across every shard (see HistoryQuery)."""
        return await read_history(self.redis, self.config, query or HistoryQuery())

    async def next_due(self, per_rule: int = DEFAULT_SHOWN) -> dict[str, Any]:
        """The earliest ``per_rule`` pending keys of each rule, with the server clock:
        ``{"now_ms", "rules": {RULE: [{"key", "due_ms", "shard"}, ...]}}``."""
        return await next_due(self.redis, self.config, per_rule)

    async def dead_letters(self, keys: Sequence[str] | None = None, *, rule: str | None = None,
                           limit: int = 20, offset: int = 0) -> DeadPage:
        """A page of dead letters, oldest first, with the total count.

        With ``keys``, those keys' dead letters (``not_dead`` lists the named keys
        that are not dead); else every dead key, or those of ``rule`` (KeyError if
        there is no such rule), ``limit`` from ``offset``.
        """
        if keys is not None:
            return await look_up_dead(self.redis, self.config, keys)
        return await list_dead(self.redis, self.config, rule=rule, limit=limit, offset=offset)

    async def retry_dead_letters(self, keys: Sequence[str] | None = None, *,
                                 rule: str | None = None) -> DeadOutcome:
        """Re-queue dead keys, due now with fresh attempts: the named ``keys``, else
        every dead key (of ``rule``, if given). Named keys that are not dead are left
        alone and listed in ``not_dead``."""
        return await self._on_dead(self._scripts.requeue_each, keys, rule)

    async def purge_dead(self, keys: Sequence[str] | None = None, *,
                         rule: str | None = None) -> DeadOutcome:
        """Delete dead keys for good (state and dead letter): the named ``keys``, else
        every dead key (of ``rule``, if given). Only keys still dead are purged; the
        named others are listed in ``not_dead``. A purged key touched again starts
        a fresh burst."""
        return await self._on_dead(self._scripts.purge, keys, rule)

    async def _on_dead(self, action: Action, keys: Sequence[str] | None,
                       rule: str | None) -> DeadOutcome:
        if self._conn is None:
            raise ClosedError("the coalescer is not running")
        if keys is not None:
            return await act_on_keys(self.config, action, keys)
        return await act_on_all(self._conn.client, self.config, action, rule)

    def leads(self) -> list[int]:
        """The shards this node leads now."""
        return sorted(self._led)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Coalescer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        self.after_fork()
        if self._state not in ("new", "forked"):
            raise ClosedError(f"start(): the coalescer is already {self._state}")
        self._state = "starting"
        root = self._embedded_root or project_root(self.config.source)
        url, self._embedded = resolve_redis_url(self._redis_url, root)
        try:
            self._conn = await connect(url)
        except BaseException:
            self._release_embedded()
            self._state = "closed"
            raise
        self._scripts = scripts = Scripts(self._conn.client)
        self._flusher = Flusher(self._absorber, scripts, self.keyspace, self.metrics)
        self._spawn("flusher", self._flusher.run())
        self._spawn("metrics", self._metrics_loop())
        if self.worker:
            self._start_worker(scripts)
        self._state = "running"
        where = f" (embedded server at {self._embedded.root})" if self._embedded else ""
        log.info("coalescer %s started on %s%s (worker=%s, %s)", self.node_id,
                 redact(self._conn.url), where, self.worker, plural(self.config.shards, "shard"))

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"coalescer {name}")
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died: %r", task.get_name(), task.exception(),
                      exc_info=task.exception())

    def _invokers(self) -> dict[str, Invoke]:
        self.config = self.config.with_handlers()  # a writer's drain() imports them here
        sync_slots = sum(r.concurrency for r in self.config.rules if callable(r.handler))
        self._executor = ThreadPoolExecutor(max_workers=max(4, min(64, sync_slots)),
                                            thread_name_prefix="coalescer-handler")
        if any(isinstance(r.handler, HttpHandler) for r in self.config.rules):
            from coalescer.worker.webhooks import Webhooks
            self.webhooks = Webhooks()
        return {r.name: invoker_for(r, self._executor, self.webhooks) for r in self.config.rules}

    def _start_worker(self, scripts: Scripts) -> None:
        assert self._conn is not None
        cfg = self.config
        self._runner = runner = Runner(
            scripts=scripts, keyspace=self.keyspace, metrics=self.metrics,
            invokers=self._invokers(), claim_lease=cfg.claim_lease,
            on_slot_free=self._slot_freed, history=History(self.node_id, cfg.history),
            hints=self.hints)
        registry = RegistryWatch(shard=self.keyspace.shard(0), scripts=scripts,
                                 node_id=self.node_id, rules=cfg.rules,
                                 leader_lease=cfg.leader_lease, metrics=self.metrics)
        for sk in self.keyspace.all_shards():
            poller = Poller(shard=sk, scripts=scripts, runner=runner, rules=cfg.rules,
                            node_id=self.node_id, leader_lease=cfg.leader_lease,
                            claim_lease=cfg.claim_lease, wake=asyncio.Event())
            adopter = Adopter(shard=sk, scripts=scripts, runner=runner, rules=cfg.rules,
                              node_id=self.node_id, leader_lease=cfg.leader_lease,
                              claim_lease=cfg.claim_lease, sleep_cap=poller.sleep_cap)
            self._leaderships.append(Leadership(
                shard=sk, scripts=scripts, poller=poller, node_id=self.node_id,
                leader_lease=cfg.leader_lease, total_shards=cfg.shards, led=self._led,
                metrics=self.metrics, adopter=adopter, rules_entry=encode(cfg.rules),
                registry=registry, lead_log=self._lead_log))
        routes = {ls_.poller_channel: ls_.on_message for ls_ in self._leaderships}
        listener = WakeListener(self._conn.pubsub_client, routes, self._poke_all, self.metrics)
        self._spawn("wakeups", listener.run())
        self._spawn("outbox", runner.outbox_loop())
        self._spawn("renew", runner.renew_loop())
        for ls_ in self._leaderships:
            self._spawn(f"shard {ls_.shard}", ls_.run())
        self._spawn("registry", registry.run())
        if cfg.sources:
            self._start_sources(self._conn)

    def _start_sources(self, conn: Connection) -> None:
        self._sources = start_sources(NodeContext(
            config=self.config, conn=conn, node_id=self.node_id, touch_many=self.touch_many,
            flush=self.flush, metrics=self.metrics))

    def _slot_freed(self) -> None:
        for ls_ in self._leaderships:
            ls_.poller.slots_freed()
            if ls_.adopter is not None and ls_.adopter.starved:
                ls_.adopter.poke()

    def _poke_all(self) -> None:
        for ls_ in self._leaderships:
            if ls_.leading:
                ls_.poller.poke()

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sync_metrics()
            self.metrics.buffered.set(len(self._absorber))
            if self._leaderships:
                self._lead_log.tick()

    async def close(self) -> None:
        """Stop taking work, flush, drain refreshes up to ``grace``, release leases.

        Idempotent: a second call waits for the first to finish.
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
            await self._shutdown()
        finally:
            self._state = "closed"
            self._closed.set()

    async def _shutdown(self) -> None:
        await self._quietly("stop sources", self._stop_sources())
        for ls_ in self._leaderships:
            ls_.stop()
        await self._quietly("flush", self._final_flush())
        if self._leaderships:
            await self._quietly("release leases", asyncio.gather(
                *(ls_.stopped() for ls_ in self._leaderships)))
            self._lead_log.tick(final=True)
        if self._runner is not None:
            await self._runner.drain(self.grace)
            await self._quietly("record results", self._runner.flush_outbox(), timeout=5.0)
        for task in self._tasks:
            task.cancel()
        done, stuck = await asyncio.wait(self._tasks, timeout=5.0) if self._tasks else ((), ())
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.warning("shutdown: %s had failed: %r", task.get_name(), task.exception())
        if stuck:
            log.warning("shutdown: %d background tasks did not stop within 5s: %s",
                        len(stuck), ", ".join(t.get_name() for t in stuck))
        await self._close_resources()
        log.info("coalescer %s closed", self.node_id)

    async def _stop_sources(self) -> None:
        sources, self._sources = self._sources, []
        await stop_sources(sources)

    async def _final_flush(self) -> None:
        assert self._flusher is not None
        await self._flusher.flush()
        self.sync_metrics()

    async def _quietly(self, what: str, aw: Any, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(aw, timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("shutdown: %s failed: %r", what, exc)

    async def _close_resources(self) -> None:
        if self.webhooks is not None:
            await self.webhooks.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._conn is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._conn.close()
        self._release_embedded()

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
        """In a forked child (no-op elsewhere): park, never close, the parent's loop
        objects, connections and buffered touches (the parent writes those), and
        start over as if just constructed; a started coalescer must be started again.
        """
        if self._pid == os.getpid():
            return
        parent, state = self._pid, self._state
        if state == "closed":
            self._pid = os.getpid()
            return
        old = dict(vars(self))
        forksafe.park(old)
        self.__dict__.clear()
        Coalescer.__init__(self, old["config"], **old["_args"])
        if state != "new":
            self._state, self._forked_from = "forked", parent
        log.debug("coalescer: process %d forked from %d, where it was %s", self._pid,
                  parent, state)

    def _release_embedded(self) -> None:
        if self._embedded is not None:
            self._embedded.release()
            self._embedded = None
