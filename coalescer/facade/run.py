"""``Run``: what one start of a coalescer creates and owns, from its touch buffer to its
background tasks. A forked child parks its parent's run whole, never closing it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from coalescer.common.metrics import Metrics
from coalescer.sources.base import Source, stop_sources
from coalescer.store.audit_stream import AuditStream
from coalescer.store.connection import Connection
from coalescer.store.embedded import EmbeddedServer
from coalescer.store.eviction import PolicyWatch
from coalescer.store.layout import Layouts
from coalescer.store.scripts import Scripts
from coalescer.worker.handlers import Handlers
from coalescer.worker.node import Node
from coalescer.write.absorber import Absorber
from coalescer.write.flusher import Flusher
from coalescer.write.quota import Quota

log = logging.getLogger(__name__)


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
        self.audit: AuditStream | None = None  # made at the first operator action

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
        if self.audit is not None:
            await self.audit.settle()  # the operator actions' entries, before the connection goes
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

    def sync_metrics(self) -> None:
        """Bring the touch counters of ``metrics`` up to date with the absorber's."""
        touches, absorbed = self.absorber.touches, self.absorber.absorbed
        self.metrics.touches.inc(touches - self.seen[0])
        self.metrics.absorbed.inc(absorbed - self.seen[1])
        self.seen = (touches, absorbed)
        waits = (self.absorber.waits, self.absorber.waited_for_take)
        self.metrics.touch_waits.inc(waits[0] - self.waits_seen[0])
        self.metrics.flusher_waits.inc(waits[1] - self.waits_seen[1])
        self.waits_seen = waits


def _task_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died: %r", task.get_name(), task.exception(),
                  exc_info=task.exception())
