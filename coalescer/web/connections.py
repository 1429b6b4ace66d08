"""Bounded connections for the HTTP API: a cap on open connections applied where
sockets are accepted, deadlines on request headers, and a flood summarised in one
log line a period.

aiohttp closes idle keep-alive connections itself (``keepalive_timeout``, given
``idle_timeout``) but has no deadline on reading request headers and no cap on
connections, so every socket accepted (by the ``Listener`` of ``listener.py``, which
also keeps asyncio from logging a traceback for each failed accept) is wrapped in a
``GuardedConnection`` before aiohttp sees it. What happens at the cap, the slots kept
for ``/healthz`` and the deadlines: docs/http.md, "Limits: slow clients and connection
floods". A body's deadline (``body_timeout``) is applied where the API reads it.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.web.listener import Listener, bind
from coalescer.web.requests import Refusal

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_IDLE_TIMEOUT = 30.0
BACKLOG = 64  # the listen queue, and the most sockets asyncio accepts in one go
MAX_CONNECTIONS_CEILING = 1024  # the default cap, however high the file limit
MIN_DERIVED_CONNECTIONS = 8
SUMMARY_PERIOD = 10.0  # seconds between two summary lines of a flood

RequestHandler = Callable[[BaseRequest], Awaitable[StreamResponse]]
ProtocolFactory = Callable[[], asyncio.Protocol]


def file_limit() -> int | None:
    """The soft limit on open files of this process (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def fitting_connections(limit: int | None) -> int:
    """The most connections a file limit of ``limit`` leaves room for: half of the
    limit less a full accept backlog (the other half stays for Redis, webhooks and
    logs), between 8 and 1024."""
    if limit is None:
        return MAX_CONNECTIONS_CEILING
    return max(MIN_DERIVED_CONNECTIONS, min(MAX_CONNECTIONS_CEILING, limit // 2 - BACKLOG))


def _warn_over_file_limit(max_connections: int | None) -> None:
    limit = file_limit()
    if max_connections is None or max_connections <= fitting_connections(limit):
        return
    log.warning("HTTP API: max_connections=%d is more than a file limit of %d leaves room "
                "for (%d): a flood can run the node out of file descriptors; raise the "
                "limit (ulimit -n) or lower max_connections", max_connections, limit,
                fitting_connections(limit))


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be over 0 seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How much of the node one client, or many, may hold.

    ``max_connections`` None: derived from the file limit (``fitting_connections``).
    """

    max_connections: int | None = None
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT

    def __post_init__(self) -> None:
        cap = self.max_connections
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 2):
            raise ValueError("max_connections must be a whole number of at least 2 (one is "
                             f"kept for /healthz), got {cap!r}")
        _positive("header_timeout", self.header_timeout)
        _positive("body_timeout", self.body_timeout)
        _positive("idle_timeout", self.idle_timeout)

    @property
    def cap(self) -> int:
        """The connection cap in force."""
        if self.max_connections is not None:
            return self.max_connections
        return fitting_connections(file_limit())

    @property
    def reserve(self) -> int:
        """Slots running requests never take: kept for /healthz (1 to 8)."""
        return max(1, min(8, self.cap // 16))


class _Phase(enum.Enum):
    IDLE = "idle"  # no request started: just accepted, or between two requests
    HEADERS = "headers"  # a request's first bytes came, its headers are not complete
    ACTIVE = "active"  # a request is being handled (its body read, its answer made)
    CLOSED = "closed"


class GuardedConnection(asyncio.Protocol):
    """One accepted socket: admitted by the guard before aiohttp's protocol is made,
    then every event is passed on to it."""

    def __init__(self, guard: ConnectionGuard, make_inner: ProtocolFactory) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._phase = _Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None

    @property
    def phase(self) -> str:
        return self._phase.value

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._guard.admit(self):
            self._phase = _Phase.CLOSED
            transport.abort()
            return
        self._inner = self._make_inner()
        self._guard.adopt(self, self._inner)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.IDLE:
            self._phase = _Phase.HEADERS
            self._guard.touched(self)
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._guard.limits.header_timeout, self._headers_late)
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._phase = _Phase.CLOSED
        inner, self._inner = self._inner, None
        self._guard.forget(self, inner)
        if inner is not None:
            inner.connection_lost(exc)

    # -- driven by the guard --

    def request_started(self) -> None:
        self._stop_timer()
        if self._phase is not _Phase.CLOSED:
            self._phase = _Phase.ACTIVE

    def request_ended(self) -> None:
        if self._phase is _Phase.ACTIVE:
            self._phase = _Phase.IDLE

    def cut_off(self) -> None:
        """Close at once, dropping what is unsent (the cap needs the slot now)."""
        self._stop_timer()
        self._phase = _Phase.CLOSED
        if self._transport is not None:
            self._transport.abort()

    def _headers_late(self) -> None:
        self._timer = None
        if self._phase is not _Phase.HEADERS:
            return
        self._guard.note("header_timeout")
        self._phase = _Phase.CLOSED
        self._guard.forget(self, self._inner)
        if self._transport is not None:
            self._transport.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class PressureLog:
    """Counts of what the limits turned away, logged as one WARNING line a period
    while anything happens (never a line per connection)."""

    def __init__(self, describe: Callable[[dict[str, int]], str],
                 period: float = SUMMARY_PERIOD) -> None:
        self._describe = describe
        self._period = period
        self._counts: dict[str, int] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._since = 0.0

    def note(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        if self._handle is None:
            loop = asyncio.get_running_loop()
            self._since = loop.time()
            self._handle = loop.call_later(self._period, self.flush)

    def flush(self) -> None:
        """Log what was counted since the last line (nothing when nothing was); the line
        says how long that was: the period, or less when the API closes."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        counts, self._counts = self._counts, {}
        if counts:
            elapsed = asyncio.get_running_loop().time() - self._since
            log.warning("HTTP API, last %s s: %s", max(1, round(min(elapsed, self._period))),
                        self._describe(counts))


class ConnectionGuard:
    """The limits of one running HTTP API: admits, tracks and closes its connections."""

    def __init__(self, limits: ConnectionLimits, *, metrics: Metrics | None = None,
                 reserved_paths: Iterable[str] = ("/healthz",),
                 period: float = SUMMARY_PERIOD) -> None:
        self.limits = limits
        self.cap = limits.cap
        self._reserve = limits.reserve
        self._reserved_paths = frozenset(reserved_paths)
        self._metrics = metrics
        self._waiting: OrderedDict[GuardedConnection, None] = OrderedDict()  # oldest first
        self._active: set[GuardedConnection] = set()
        self._by_inner: dict[asyncio.BaseProtocol, GuardedConnection] = {}
        self._accept_error = ""
        self.pressure = PressureLog(self._describe, period)
        _warn_over_file_limit(limits.max_connections)
        if metrics is not None:
            metrics.http_connections_max.set(self.cap)

    @property
    def open(self) -> int:
        return len(self._waiting) + len(self._active)

    def protocol_factory(self, make_inner: ProtocolFactory) -> ProtocolFactory:
        """What ``loop.create_server`` is given: every socket goes through the guard."""
        return lambda: GuardedConnection(self, make_inner)

    def wrap(self, handler: RequestHandler) -> RequestHandler:
        """``handler`` (aiohttp's, called once a request's headers are complete) marking
        its connection busy while it runs, or answering 503 when too many run."""

        async def guarded(request: BaseRequest) -> StreamResponse:
            connection = self._by_inner.get(request.protocol)
            if connection is None:  # closed meanwhile
                return await handler(request)
            busy = self._too_busy(request.path)
            self._request_started(connection)
            try:
                return self._busy_answer() if busy else await handler(request)
            finally:
                self._request_ended(connection)

        return guarded

    # -- admission --

    def admit(self, connection: GuardedConnection) -> bool:
        """True if ``connection`` may stay; at the cap, the oldest idle or unfinished
        connection is closed to make room, or else ``connection`` is refused."""
        if self.open >= self.cap:
            if not self._waiting:
                self.note("refused")
                return False
            oldest, _ = self._waiting.popitem(last=False)
            oldest.cut_off()
            self.note("evicted")
        self._waiting[connection] = None
        self._gauge()
        return True

    def adopt(self, connection: GuardedConnection, inner: asyncio.BaseProtocol) -> None:
        self._by_inner[inner] = connection

    def touched(self, connection: GuardedConnection) -> None:
        """A request began on an idle connection: it is the youngest now."""
        if connection in self._waiting:
            self._waiting.move_to_end(connection)

    def forget(self, connection: GuardedConnection, inner: asyncio.BaseProtocol | None) -> None:
        """``connection`` is closed (or closing): its slot is free."""
        self._waiting.pop(connection, None)
        self._active.discard(connection)
        if inner is not None:
            self._by_inner.pop(inner, None)
        self._gauge()

    def _request_started(self, connection: GuardedConnection) -> None:
        connection.request_started()
        if connection.phase == _Phase.ACTIVE.value:  # not closed meanwhile
            self._waiting.pop(connection, None)
            self._active.add(connection)

    def _request_ended(self, connection: GuardedConnection) -> None:
        connection.request_ended()
        if connection in self._active:
            self._active.discard(connection)
            self._waiting[connection] = None

    def _too_busy(self, path: str) -> bool:
        return len(self._active) >= self.cap - self._reserve and path not in self._reserved_paths

    def slots_full(self, request: BaseRequest | None = None) -> str | None:
        """Why a request on another path than the reserved ones (a touch) would be
        answered 503 now: every slot running requests may take is held (``request``'s
        own connection not counted); None when one is free."""
        own = self._by_inner.get(request.protocol) if request is not None else None
        running = len(self._active) - (own in self._active)
        if running < self.cap - self._reserve:
            return None
        return (f"every request slot is taken: {running} requests running (the cap of "
                f"{self.cap} connections less {self._reserve} kept for /healthz), so "
                "touches are answered 503")

    def _busy_answer(self) -> web.Response:
        self.note("busy")
        running = self.cap - self._reserve
        refusal = Refusal(503, f"the node is running {running} requests already (its cap of "
                               f"{self.cap} connections less {self._reserve} kept for "
                               "/healthz); retry later")
        refusal.close = True
        response = refusal.response()
        response.headers["Retry-After"] = "1"
        return response

    # -- accounting --

    def note(self, reason: str) -> None:
        """Count one connection or request turned away (summarised, never one line each)."""
        self.pressure.note(reason)
        if self._metrics is not None:
            self._metrics.http_cut_off.labels(reason).inc()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.http_connections.set(self.open)

    def _describe(self, counts: dict[str, int]) -> str:
        limits = self.limits
        phrases = {  # reason: (noun, what happened)
            "evicted": ("connection", f"over the cap of {self.cap}: the oldest idle or "
                                      "unfinished closed to make room"),
            "refused": ("connection", f"over the cap of {self.cap} refused (every one busy)"),
            "header_timeout": ("connection", "closed with request headers unfinished after "
                                             f"{limits.header_timeout:g} s"),
            "body_timeout": ("request", f"answered 408: body unfinished after "
                                        f"{limits.body_timeout:g} s"),
            "busy": ("request", "answered 503: too many running"),
            "accept_failed": ("accept", f"failed ({self._accept_error or 'out of resources'})"),
        }
        return "; ".join(f"{plural(counts[reason], word)} {what}"
                         for reason, (word, what) in phrases.items() if counts.get(reason))

    def accept_failed(self, exc: OSError) -> None:
        """accept() failed (out of file descriptors, mostly): counted, not logged each."""
        self._accept_error = exc.strerror or str(exc)
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            self._accept_error += ": raise the file limit (ulimit -n)"
        self.note("accept_failed")

    def close(self) -> None:
        """Log what is counted and not yet logged."""
        self.pressure.flush()


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, its sockets accepted by a ``Listener`` and admitted by a
    ``ConnectionGuard`` before aiohttp sees them."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=BACKLOG)
        server = runner.server
        assert server is not None  # the runner is set up
        server.request_handler = guard.wrap(server.request_handler)
        self._guard = guard
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        sockets = await bind(self._host, self._port, self._backlog)
        self._server = Listener(sockets, self._guard.protocol_factory(server),
                                self._guard.accept_failed)

    async def stop(self) -> None:
        await super().stop()
        self._guard.close()
