"""``Draining``: ``drain()``, which runs everything pending now through this process's
handlers (a test's way to see refreshes happen), reading the rules file's sources
first: a worker's running ones, else ones opened for the drain's length."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from coalescer.claim import Claim
from coalescer.facade.core import Core, refuse_sources_that_cannot_run
from coalescer.facade.run import Run
from coalescer.sources.base import NodeContext as SourceContext
from coalescer.sources.base import open_sources, read_sources, stop_sources
from coalescer.worker.drain import Drainer, ReadSources, local_runner
from coalescer.worker.handlers import Handlers
from coalescer.worker.runner import Runner


class Draining:
    """The drains of one coalescer (see ``Coalescer.drain``)."""

    def __init__(self, core: Core, source_context: Callable[[Run], SourceContext]) -> None:
        self.core = core
        self.source_context = source_context

    async def drain(self, timeout: float, sources: bool) -> list[Claim]:
        core = self.core
        run = core._running("drain()")
        async with self._sources_for_drain(sources) as read:
            if run.node is not None:
                return await self._drainer(run.node.runner, read).run(timeout)
            if run.handlers is None:
                core.config = core.config.with_handlers()  # a writer's drain imports them
                run.handlers = Handlers(core.config, processes=False)  # in this process
            async with local_runner(core._context(), invokers=run.handlers.invokers) as runner:
                return await self._drainer(runner, read).run(timeout)

    def _drainer(self, runner: Runner, read: ReadSources | None) -> Drainer:
        core = self.core
        return Drainer(core._context(), runner=runner, flush=core.flush, redis=core.redis,
                       read_sources=read)

    @contextlib.asynccontextmanager
    async def _sources_for_drain(self, wanted: bool) -> AsyncIterator[ReadSources | None]:
        """What reads the rules file's sources once, for a drain: a worker's running
        sources, else the sources opened for the drain's length (closed after)."""
        run = self.core._run
        if not wanted or not self.core.config.sources:
            yield None
            return
        running = run.sources
        if running:
            yield lambda deadline: read_sources(running, deadline)
            return
        refuse_sources_that_cannot_run(self.core.config)
        opened = open_sources(self.source_context(run), for_drain=True)
        try:
            yield lambda deadline: read_sources(opened, deadline)
        finally:
            await stop_sources(opened)
