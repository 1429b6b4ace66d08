"""What a worker node needs of a source type, and the registry of types by ``type:``.

A type registers a ``SourceType``: how to open its running ``Source`` for the sources
of that type in the rules file, and what ``coalescer status`` shows of each of them.
``start_sources`` starts every configured source of a node; ``read_sources`` reads,
once, what every source holds now (what ``drain()`` does before it runs what is pending).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from coalescer.common.metrics import Metrics
from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig, with_group, with_own_group
from coalescer.errors import ConfigError, SourceReadError
from coalescer.sources.times import TouchTimed
from coalescer.store.connection import Connection

log = logging.getLogger(__name__)

TouchMany = Callable[[list[str]], None]
TouchItems = Callable[[list[tuple[str, str]]], None]  # (key, item) touches, all or none
Flush = Callable[[], Awaitable[None]]
# (key, W3C traceparent) of touches whose producer sent its trace context: the refresh
# links to the producer's span (coalescer/tracing)
TraceLinks = Callable[[list[tuple[str, str]]], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeContext:
    """What a worker node lends its sources: its config and connection, its id (a
    source's consumer name), and how to touch keys and flush them to Redis."""

    config: Config
    conn: Connection
    node_id: str
    touch_many: TouchMany
    flush: Flush
    metrics: Metrics
    touch_items: TouchItems | None = None  # for sources whose entries carry an item
    # touches with a time of their own (a source's at:/delay:, see sources/times.py)
    touch_timed: TouchTimed | None = None
    trace_links: TraceLinks | None = None  # None: tracing off


class Source(ABC):
    """The running sources of one type on one worker node."""

    @abstractmethod
    def start(self) -> None:
        """Start reading, in tasks on the running event loop; returns at once."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop reading and release what it holds; nothing read may be lost."""

    def problems(self) -> list[str]:
        """What keeps these sources from reading now (shown by /healthz); none by default."""
        return []

    @abstractmethod
    def readers(self) -> list[Reader]:
        """One ``Reader`` per source: what reads, once, everything the source holds now,
        touches, flushes and commits it as the running loop would (never both at once)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reader:
    """Reads one source once up to now: ``read()`` returns how many events it handled;
    ``name`` and ``what`` (e.g. "outbox coalescer_outbox at sqlite:///app.db") name it
    in errors."""

    name: str
    what: str
    read: Callable[[], Awaitable[int]]


OpenSources = Callable[[Sequence[SourceConfig], NodeContext], Source]
ReadStatus = Callable[[Any, SourceConfig, Config], Awaitable[dict[str, Any]]]
# What keeps one source from running on this node (a driver not installed, an
# environment variable not set): errors naming its file, line and field.
CheckSource = Callable[[SourceConfig, int, Config, Mapping[str, str]], list[ConfigError]]


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceType:
    """One type of source: ``open`` builds the running ``Source`` of a node's sources
    of this type; ``status`` reads, with a Redis client of ``decode_responses``, what
    ``coalescer status`` shows of one of them (besides its rejected entries); ``check``,
    if given, says why one of them could not run on this node."""

    name: str
    open: OpenSources
    status: ReadStatus
    check: CheckSource | None = None


SOURCE_TYPES: dict[str, SourceType] = {}


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Loop(Protocol):
    """One source's reading loop: ``run()`` until cancelled, or ``read_now()`` once
    (``what`` names it in errors)."""

    @property
    def source(self) -> _Named: ...

    @property
    def what(self) -> str: ...

    async def run(self) -> None: ...

    async def read_now(self) -> int: ...


L = TypeVar("L", bound=Loop)


class LoopSources(Source, Generic[L]):
    """The running sources of one type, a reading loop each, a task per loop (named
    after its source) while started."""

    def __init__(self, loops: list[L]) -> None:
        self.loops = loops
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(loop.run(), name=f"coalescer source "
                                           f"{loop.source.name}") for loop in self.loops]

    def readers(self) -> list[Reader]:
        return [Reader(name=loop.source.name, what=loop.what, read=loop.read_now)
                for loop in self.loops]

    async def cancel_loops(self) -> None:
        """Cancel the loops' tasks and wait for them all to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []


def register(source_type: SourceType) -> SourceType:
    """Make ``source_type`` the one a source of its ``type:`` runs with."""
    SOURCE_TYPES[source_type.name] = source_type
    return source_type


def check_sources(config: Config, environ: Mapping[str, str]) -> list[ConfigError]:
    """Why the sources of ``config`` could not run on this node, each error with the
    file, line and field; empty when they can. A worker refuses to start otherwise."""
    problems: list[ConfigError] = []
    for index, source in enumerate(config.sources):
        check = SOURCE_TYPES[source.type].check
        if check is not None:
            problems += check(source, index, config, environ)
    return problems


def open_sources(context: NodeContext, *, for_drain: bool = False) -> list[Source]:
    """Open (not start) the sources of ``context.config``, one ``Source`` per type, each
    in its group (derived from the namespace when its rules name none; ``for_drain``:
    derived from the namespace whatever its rules name)."""
    grouped = with_own_group if for_drain else with_group
    by_type: dict[str, list[SourceConfig]] = {}
    for source in context.config.sources:
        by_type.setdefault(source.type, []).append(grouped(source, context.config.namespace))
    # each type the rules file allows registers
    return [SOURCE_TYPES[name].open(sources, context) for name, sources in by_type.items()]


def start_sources(context: NodeContext) -> list[Source]:
    """Open and start the sources of ``context.config``, one ``Source`` per type."""
    started = open_sources(context)
    for running in started:
        running.start()
        log.debug("started %d %s source(s)", len(running.readers()), type(running).__name__)
    return started


async def read_sources(sources: Sequence[Source], deadline: float) -> int:
    """Read every one of ``sources`` once up to now, in order, by ``deadline`` (a
    ``time.monotonic()`` value); how many events they handled. SourceReadError naming
    the source when one cannot be read, or does not answer by then."""
    total = 0
    for source in sources:
        for reader in source.readers():
            total += await _read_one(reader, deadline)
    return total


async def _read_one(reader: Reader, deadline: float) -> int:
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(reader.read(), left)
    except TimeoutError as exc:
        raise SourceReadError(
            reader.name, f"source {reader.name!r} ({reader.what}) could not be read "
            "before the deadline: is it reachable?") from exc
    except Exception as exc:
        raise SourceReadError(
            reader.name, f"source {reader.name!r} ({reader.what}) could not be read: "
            f"{type(exc).__name__}: {exc}") from exc


async def stop_sources(sources: Sequence[Source]) -> None:
    """Stop every one of ``sources``, in order."""
    for source in sources:
        await source.stop()
