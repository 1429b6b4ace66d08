"""The HTTP surface of a node: POST /touch, GET /healthz, /status, /metrics,
GET and DELETE /keys/{key} (explain, cancel), POST /keys/{key}/run (run now),
POST /rules/{rule}/pause and /resume, and the status page at GET / with the endpoints
it reads (``page``), served with aiohttp: docs/http.md. Who may call what (``roles``),
what a browser on another site is refused (``guards``) and the connection limits
(``connections``) are their modules'. A refused /touch applies nothing: the whole body
is validated, unknown keys included, before the first key is touched.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import http_caller, keys_target, operator_action
from coalescer.common.plural import noun, plural
from coalescer.common.printable import printable
from coalescer.errors import (
    BackpressureError,
    ClosedError,
    CoalescerError,
    InvalidItemError,
    InvalidKeyError,
    QuotaExceededError,
    UnknownKeyError,
)
from coalescer.query.fair_status import fair_gauges
from coalescer.web import openapi
from coalescer.web.connections import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    ConnectionGuard,
    ConnectionLimits,
    GuardedSite,
)
from coalescer.web.fair_api import fair_settings
from coalescer.web.guards import (
    cross_site_guard,
    host_guard,
    is_loopback,
    json_body_guard,
    page_csp,
    security_headers,
)
from coalescer.web.operator_api import OperatorRoutes
from coalescer.web.page import PageRoutes
from coalescer.web.requests import (
    SHOWN_KEYS,
    Refusal,
    check_content_type,
    key_read_refusals,
    parse_touch,
    refuse_bad_items,
    refuse_bad_priority,
    refuse_bad_time,
    refuse_unstorable,
    unreadable,
)
from coalescer.web.roles import ApiToken, all_tokens, caller, roles_middleware, whoami
from coalescer.web.scheduled_api import cancel_scheduled
from coalescer.web.timeline_api import timeline, trace_url_from_env

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_MAX_BODY = 1024 * 1024
PING_TIMEOUT = 2.0
STATUS_TIMEOUT = 10.0
DEFAULT_MAX_UNWRITTEN_AGE = 10.0  # /healthz is 503 once a touch waits this long for Redis
OPEN_PATHS = ("/healthz", "/")  # served without the token

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- middlewares -----------------------------------------------------------------------


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refusals and aiohttp's own HTTP errors (404, 405, ...) as JSON."""
    try:
        return await handler(request)
    except Refusal as refusal:
        return refusal.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": exc.reason}, status=exc.status,
                                 headers={k: v for k, v in exc.headers.items()
                                          if k.lower() == "allow"})
    except Exception as exc:  # a bug: logged once with its cause; the client learns nothing
        log.error("HTTP %s %s failed: %r", request.method, printable(request.path), exc,
                  exc_info=exc)
        return web.json_response({"error": "internal error"}, status=500)


# --- the server ------------------------------------------------------------------------


class OpenApiError(CoalescerError):
    """The HTTP API would be open to the network without a token."""


def refuse_open(host: str, port: int, token: str | None, *, allowed: str) -> None:
    """Raise OpenApiError when ``host`` is not loopback and there is no token; the
    message names the address and the fixes (``allowed``: how to say it is meant)."""
    if token or is_loopback(host):
        return
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise OpenApiError(f"refusing to serve the HTTP API on {shown} without a token: anyone "
                       "who reaches it could touch keys and read status; set "
                       "COALESCER_TOKEN=<secret>, or bind it to 127.0.0.1 "
                       f"({allowed} serves it open anyway)")


class HttpApi:
    """The aiohttp server of one coalescer node."""

    def __init__(self, coalescer: Coalescer, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 token: str | None = None, max_body: int = DEFAULT_MAX_BODY,
                 max_unwritten_age: float = DEFAULT_MAX_UNWRITTEN_AGE,
                 allow_open: bool = False,
                 max_connections: int | None = None,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 tokens: Sequence[ApiToken] = ()) -> None:
        """``tokens``: named tokens with their roles, besides the operator ``token``
        (coalescer.web.roles).
        ``allow_open``: serve without a token on an address that is not loopback
        (else OpenApiError, here). The connection limits (``max_connections``, None:
        from the file limit; ``header_timeout``, ``body_timeout``, ``idle_timeout`` in
        seconds) are described in ``coalescer.web.connections``."""
        if max_body < 1:
            raise ValueError(f"max_body must be at least 1 byte, got {max_body}")
        if not max_unwritten_age > 0:
            raise ValueError(f"max_unwritten_age must be over 0 seconds, got {max_unwritten_age}")
        self._max_unwritten_age = max_unwritten_age
        self._limits = ConnectionLimits(max_connections, header_timeout, body_timeout,
                                        idle_timeout)  # see connections.py
        self._c = coalescer
        self._host = host
        self._port = port
        self._token = token or None
        self._tokens = all_tokens(self._token, tokens)
        if self._token is None and self._tokens:  # any token turns the token check on
            self._token = self._tokens[0].secret
        if not allow_open:
            refuse_open(host, port, self._token, allowed="allow_open=True")
        self._max_body = max_body
        self._runner: web.AppRunner | None = None
        self._guard: ConnectionGuard | None = None
        self._bound: int | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with ``port=0``)."""
        return self._bound if self._bound is not None else self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def make_app(self) -> web.Application:
        page = PageRoutes(self._c, self._read_body, self._who)
        middlewares = [security_headers(page_csp(page.html)), _error_middleware]
        if self._token is None:
            middlewares.append(host_guard(self._host))  # with a token, the token guards
        middlewares += [cross_site_guard, json_body_guard]
        if self._token is not None:
            middlewares.append(roles_middleware(self._tokens, OPEN_PATHS))
        app = web.Application(client_max_size=self._max_body, middlewares=middlewares)
        app.router.add_post("/touch", self._touch)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/keys/{key:.+}/timeline", self._timeline)  # before explain's
        app.router.add_get("/keys/{key:.+}", self._explain)
        app.router.add_delete("/keys/{key:.+}", self._cancel)
        app.router.add_post("/keys/{key:.+}/run", self._run_now)
        app.router.add_post("/rules/{rule}/pause", self._pause)
        app.router.add_post("/rules/{rule}/resume", self._resume)
        app.router.add_delete("/rules/{rule}/scheduled", self._cancel_scheduled)
        app.router.add_get("/rules/{rule}/fair", self._fair)
        app.router.add_post("/rules/{rule}/fair", self._fair)
        page.register(app)
        app.router.add_get("/whoami", whoami)
        OperatorRoutes(self._c, self._read_body, self._who).register(app)
        openapi.register(app)  # last: it describes every route above
        return app

    async def start(self) -> None:
        """Bind and serve; returns once the socket listens."""
        if self._runner is not None:
            return
        if self._token is None and not is_loopback(self._host):
            log.warning("the HTTP API on %s has no token: it is open to the network, and "
                        "anyone who reaches it can touch keys and read status; set "
                        "COALESCER_TOKEN=<secret> (clients send 'Authorization: Bearer "
                        "<secret>') or bind it to 127.0.0.1", self.url)
        runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=5.0,
                               keepalive_timeout=self._limits.idle_timeout)
        await runner.setup()
        self._guard = ConnectionGuard(self._limits, metrics=self._c.metrics)
        site = GuardedSite(runner, self._host, self._port, self._guard)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._bound = int(runner.addresses[0][1])
        log.info("HTTP API listening on %s (auth %s)", self.url,
                 "on" if self._token else "off")

    async def close(self) -> None:
        """Stop serving; safe to call more than once."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> HttpApi:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- routes --

    async def _read_body(self, request: web.Request) -> bytes:
        too_big = Refusal(413, f"the body is over the limit of {self._max_body} bytes",
                          limit=self._max_body)
        if request.content_length is not None and request.content_length > self._max_body:
            raise too_big
        check_content_type(request)
        try:
            async with asyncio.timeout(self._limits.body_timeout):
                return await request.read()
        except TimeoutError:
            raise self._body_late() from None
        except web.HTTPRequestEntityTooLarge:
            raise too_big from None
        except RequestPayloadError as exc:
            raise unreadable(request, exc) from None
        except ConnectionResetError:
            log.info("POST %s: the client %s left before the body ended", request.path,
                     request.remote)
            raise Refusal(400, "the connection was lost before the body ended") from None

    def _body_late(self) -> Refusal:
        if self._guard is not None:
            self._guard.note("body_timeout")
        late = Refusal(408, f"the body did not arrive within {self._limits.body_timeout:g} s")
        late.close = True
        return late

    async def _touch(self, request: web.Request) -> web.Response:
        keys, pairs, when = parse_touch(await self._read_body(request))
        refuse_bad_time(when, [*keys, *(key for key, _ in pairs)],
                        self._c.config.limits.max_schedule_ahead)
        refuse_unstorable(keys)
        refuse_bad_items(self._c.refused_items(pairs))
        unknown = self._c.unknown_keys([*keys, *dict.fromkeys(key for key, _ in pairs)])
        if unknown:
            verb = noun(len(unknown), "matches", "match")
            raise Refusal(422, f"{plural(len(unknown), 'key')} {verb} no rule; "
                               "nothing was touched",
                          unknown_keys=unknown[:SHOWN_KEYS])
        refuse_bad_priority(when, [*keys, *(key for key, _ in pairs)], self._c.config.rule_for)
        self._apply(keys, pairs, when)
        traceparent = request.headers.get("traceparent")
        if traceparent:  # the caller's trace: the refreshes link to it (tracing on)
            self._c.link_trace([*keys, *(key for key, _ in pairs)], traceparent)
        return web.json_response({"accepted": len(keys) + len(pairs)}, status=202)

    def _apply(self, keys: list[str], pairs: list[tuple[str, str]],
               when: dict[str, Any]) -> None:
        try:
            if pairs:
                self._c.touch_items(pairs, keys=keys, **when)  # all or nothing, as touch_many
            else:
                self._c.touch_many(keys, **when)  # all or nothing, under back-pressure too
        except QuotaExceededError as exc:
            raise _over_quota(exc) from None
        except BackpressureError as exc:
            raise Refusal(503, str(exc)) from None
        except ClosedError as exc:
            raise Refusal(503, f"the node is not running: {exc}") from None
        except UnknownKeyError as exc:
            raise Refusal(422, str(exc), unknown_keys=[exc.key]) from None
        except InvalidItemError as exc:
            raise Refusal(422, str(exc), invalid_items=[
                {"key": exc.key, "item": exc.item, "error": exc.reason}]) from None
        except InvalidKeyError as exc:
            raise Refusal(422, str(exc), invalid_keys=[{"key": exc.key, "error": exc.reason}]
                          ) from None

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(PING_TIMEOUT):
                return bool(await self._c.ping())
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("healthz: ping failed: %r", exc)
            return False

    async def _healthz(self, request: web.Request) -> web.Response:
        """200 ``{"ok": true}``; 503 with the reasons (``reasons``: a list of every one
        that applies, ``error``: them joined by "; ") when Redis is not reachable,
        refuses writes (its reply: "Redis refuses writes: MISCONF ..."), has a
        maxmemory-policy that may evict coalescer's keys, a touch has waited over
        ``max_unwritten_age`` to be written, or every request slot is held (a touch
        would be answered 503). Served without the token: it shows counts
        (``dropped_keys: N``), never key names."""
        body: dict[str, Any] = {"ok": True}
        errors = [] if await self._ping() else ["Redis is not reachable"]
        errors += self._c.health_problems()
        full = self._guard.slots_full(request) if self._guard is not None else None
        if full is not None:
            errors.append(full)
        age = self._c.unwritten_age()
        if age is not None:
            body["unwritten_age_s"] = round(age, 3)
            if age > self._max_unwritten_age:
                errors.append(f"the oldest unwritten touch is {age:.1f} s old "
                              f"(bound {self._max_unwritten_age:g} s)")
        dropped = self._c.dropped_keys()
        if dropped:  # a count: this route is open, key names and Redis errors are not
            body["dropped_keys"] = len(dropped)
        if not errors:
            return web.json_response(body)
        body.update(ok=False, error="; ".join(errors), reasons=errors)
        return web.json_response(body, status=503)

    async def _read_status(self) -> dict[str, Any]:
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                return await self._c.query.status()
        except (RedisError, OSError, TimeoutError) as exc:
            raise Refusal(503, f"cannot read status from Redis: {exc!r}") from None

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self._read_status())

    async def _explain(self, request: web.Request) -> web.Response:
        """GET /keys/{key}: the JSON of `coalescer explain KEY --json`."""
        key = request.match_info["key"]
        with key_read_refusals(key, f"key {key!r}"):
            async with asyncio.timeout(STATUS_TIMEOUT):
                found = await self._c.query.explain(key)
        return web.json_response(found)

    async def _timeline(self, request: web.Request) -> web.Response:
        """GET /keys/{key}/timeline: the JSON of `coalescer timeline KEY --json`."""
        try:
            template = trace_url_from_env()
        except ValueError as exc:
            log.warning("trace links left out: $COALESCER_TRACE_URL: %s", exc)
            template = None
        return await timeline(request, self._c.query.timeline, template)

    async def _cancel(self, request: web.Request) -> web.Response:
        """DELETE /keys/{key}: drop the key's pending refresh (`coalescer cancel KEY`);
        404 when it was not pending (or no rule matches it)."""
        key = request.match_info["key"]
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                outcome = await self._c.cancel(key)
        except UnknownKeyError:
            raise Refusal(404, f"no rule matches key {key!r}", key=key) from None
        except InvalidKeyError as exc:
            raise Refusal(422, str(exc), key=key, invalid_keys=[
                {"key": exc.key, "error": exc.reason}]) from None
        except ClosedError as exc:
            raise Refusal(503, f"the node is not running: {exc}") from None
        except (RedisError, OSError, TimeoutError) as exc:
            raise Refusal(503, f"cannot cancel key {key!r} in Redis: {exc!r}") from None
        operator_action("cancel", keys_target([key]), outcome.done, self._who(request),
                        sink=self._c.audit)
        state = outcome.states[key]
        if outcome.not_pending:
            raise Refusal(404, f"key {key!r} is not pending ({state}); nothing was cancelled",
                          key=key, cancelled=False, state=state)
        return web.json_response({"cancelled": True, "key": key, "state": state})

    async def _cancel_scheduled(self, request: web.Request) -> web.Response:
        """DELETE /rules/{rule}/scheduled?after=T (web/scheduled_api.py)."""
        return await cancel_scheduled(request, self._c.cancel_scheduled,
                                      [r.name for r in self._c.config.rules],
                                      self._who(request))

    async def _fair(self, request: web.Request) -> web.Response:
        """GET/POST /rules/{rule}/fair: a fair rule's weights and cap (web/fair_api.py)."""
        body = await self._read_body(request) if request.method == "POST" else None
        return await fair_settings(request, self._c, body, self._who(request))

    async def _pause(self, request: web.Request) -> web.Response:
        """POST /rules/{rule}/pause (`coalescer pause RULE`); 404 for no such rule."""
        return await self._set_paused(request, paused=True)

    async def _resume(self, request: web.Request) -> web.Response:
        """POST /rules/{rule}/resume (`coalescer resume RULE`); 404 for no such rule."""
        return await self._set_paused(request, paused=False)

    async def _set_paused(self, request: web.Request, *, paused: bool) -> web.Response:
        rule = request.match_info["rule"]
        action = self._c.query.pause if paused else self._c.query.resume
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                changed = await action(rule)
        except KeyError:
            names = [r.name for r in self._c.config.rules]
            raise Refusal(404, f"no rule named {rule!r}", rule=rule, rules=names) from None
        except (RedisError, OSError, TimeoutError) as exc:
            raise Refusal(503, f"cannot {'pause' if paused else 'resume'} rule {rule!r} in "
                               f"Redis: {exc!r}") from None
        operator_action("pause" if paused else "resume", f"rule {printable(rule)}",
                        int(changed), self._who(request), sink=self._c.audit)
        return web.json_response({"rule": rule, "paused": paused, "changed": changed})

    async def _run_now(self, request: web.Request) -> web.Response:
        """POST /keys/{key}/run: make the key's pending refresh due now (`coalescer
        run-now KEY`); 404 when no rule matches it or it is idle, 409 when it is
        running or dead-lettered."""
        key = request.match_info["key"]
        try:
            async with asyncio.timeout(STATUS_TIMEOUT):
                outcome = await self._c.query.run_now([key])
        except UnknownKeyError:
            raise Refusal(404, f"no rule matches key {key!r}", key=key) from None
        except InvalidKeyError as exc:
            raise Refusal(422, str(exc), key=key, invalid_keys=[
                {"key": exc.key, "error": exc.reason}]) from None
        except (RedisError, OSError, TimeoutError) as exc:
            raise Refusal(503, f"cannot run key {key!r} in Redis: {exc!r}") from None
        operator_action("run-now", keys_target([key]), len(outcome.run), self._who(request),
                        sink=self._c.audit)
        state = outcome.states[key]
        if outcome.not_pending:
            raise Refusal(404 if state == "idle" else 409,
                          f"key {key!r} is not pending ({state}); nothing was run",
                          key=key, run=False, state=state)
        return web.json_response({"run": True, "key": key, "state": state})

    def _who(self, request: web.Request) -> str:
        """Who sent ``request``, for the operator actions' log lines."""
        holder = caller(request)
        return http_caller(token=self._token is not None, peer=request.remote,
                           name=holder.name if holder is not None else None)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._refresh_gauges()
        metrics = self._c.metrics
        response = web.Response(body=generate_latest(metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _refresh_gauges(self) -> None:
        """Pending, in-flight and dead per rule, from Redis; stale gauges if it is down."""
        self._c.sync_metrics()  # touch counters up to date with the absorber
        self._c.metrics.unwritten_age.set(self._c.unwritten_age() or 0.0)
        try:
            status = await self._read_status()
        except Refusal as refusal:
            log.debug("metrics: gauges not refreshed: %s", refusal)
            return
        metrics = self._c.metrics
        for rule, entry in status.get("rules", {}).items():
            metrics.pending.labels(rule).set(entry.get("pending", 0))
            metrics.in_flight.labels(rule).set(entry.get("in_flight", 0))
            metrics.dead.labels(rule).set(entry.get("dead", 0))
        fair_gauges(metrics, status)


def _over_quota(exc: QuotaExceededError) -> Refusal:
    """429 with Retry-After: the pending keys reached ``limits.pending_keys``."""
    refusal = Refusal(429, str(exc), limit=exc.limit, value=exc.value)
    refusal.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return refusal
