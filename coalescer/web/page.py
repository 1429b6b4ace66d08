"""The status page of a node's HTTP API (``GET /``: one self-contained HTML page, served
without a token, that polls the API every 2 s) and the JSON it reads besides
GET /status: ``GET /history``, ``GET /due`` and ``POST /dead/retry`` (their parameters,
answers and errors: docs/http.md, "The endpoints the page reads"). The page is served
with a Content-Security-Policy that allows its inline script and style by hash
(``coalescer.web.guards.page_csp``), so it loads nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import keys_target, operator_action
from coalescer.common.plural import noun, plural
from coalescer.errors import ClosedError
from coalescer.query.due import DEFAULT_SHOWN, MAX_SHOWN
from coalescer.query.history import HistoryQuery
from coalescer.web.requests import Refusal, parse_keys, refuse_unstorable

DEFAULT_HISTORY = 200
MAX_HISTORY = 1000
TIMEOUT = 10.0
SHOWN_KEYS = 100  # keys listed in a 422 answer at most
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")

def page_html() -> bytes:
    """The status page, read from the package."""
    return (resources.files("coalescer.web") / "static" / "status.html").read_bytes()


def _query(request: web.Request, allowed: Sequence[str]) -> dict[str, str]:
    extra = sorted(set(request.query) - set(allowed))
    if extra:
        raise Refusal(400, f"unknown query {noun(len(extra), 'parameter')} "
                       f"{', '.join(map(repr, extra))}; "
                            f"allowed: {', '.join(allowed)}")
    repeated = sorted(name for name in request.query if len(request.query.getall(name)) > 1)
    if repeated:
        raise Refusal(400, f"the query parameter {repeated[0]!r} is given more than once")
    return {name: request.query[name] for name in request.query}


def _count(query: dict[str, str], default: int, most: int) -> int:
    raw = query.get("n")
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= most:
        raise Refusal(400, f"n must be a whole number from 1 to {most}, got {raw!r}")
    return int(raw)


def _flag(query: dict[str, str], name: str) -> bool:
    raw = query.get(name, "").lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise Refusal(400, f"{name} must be 1 or 0, got {query[name]!r}")


@asynccontextmanager
async def _reading(what: str) -> AsyncIterator[None]:
    """Redis trouble as a 503 naming what could not be read or done."""
    try:
        async with asyncio.timeout(TIMEOUT):
            yield
    except ClosedError as exc:
        raise Refusal(503, f"the node is not running: {exc}") from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise Refusal(503, f"cannot {what}: {exc!r}") from None


class PageRoutes:
    """The handlers of GET /, /history, /due and POST /dead/retry."""

    def __init__(self, node: Coalescer,
                 read_body: Callable[[web.Request], Awaitable[bytes]],
                 who: Callable[[web.Request], str]) -> None:
        self._node = node
        self._who = who  # who sent a request, for the operator actions' log lines
        self._rules = [r.name for r in node.config.rules]
        self._read_body = read_body
        self.html = page_html()

    def register(self, app: web.Application) -> None:
        app.router.add_get("/", self.page)
        app.router.add_get("/history", self.history)
        app.router.add_get("/due", self.due)
        app.router.add_post("/dead/retry", self.retry)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.html, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def history(self, request: web.Request) -> web.Response:
        query = _query(request, ("n", "rule", "failed"))
        limit = _count(query, DEFAULT_HISTORY, MAX_HISTORY)
        rule = query.get("rule") or None
        if rule is not None and rule not in self._rules:
            raise Refusal(422, f"no rule is named {rule!r}", rules=self._rules)
        wanted = HistoryQuery(rule=rule, failed=_flag(query, "failed"), limit=limit)
        async with _reading("read the history from Redis"):
            found = await self._node.query.history(wanted)
        return web.json_response({"refreshes": [r.to_json() for r in found]})

    async def due(self, request: web.Request) -> web.Response:
        per_rule = _count(_query(request, ("n",)), DEFAULT_SHOWN, MAX_SHOWN)
        async with _reading("read the due keys from Redis"):
            return web.json_response(await self._node.query.next_due(per_rule))

    async def retry(self, request: web.Request) -> web.Response:
        keys = parse_keys(await self._read_body(request))
        refuse_unstorable(keys, undone="retried", first="none")
        unknown = self._node.unknown_keys(keys)
        if unknown:
            verb = noun(len(unknown), "matches", "match")
            raise Refusal(422, f"{plural(len(unknown), 'key')} {verb} no rule; "
                                "nothing was retried",
                           unknown_keys=unknown[:SHOWN_KEYS])
        async with _reading("re-queue the dead keys in Redis"):
            outcome = await self._node.query.retry_dead(keys)
        operator_action("retry", keys_target(keys), outcome.done, self._who(request),
                        sink=self._node.audit)
        return web.json_response({"retried": outcome.done, "not_dead": outcome.not_dead})
