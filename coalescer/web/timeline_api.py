"""``GET /keys/{key}/timeline[?at=T]``: the JSON of ``coalescer timeline KEY [--at T]
--json`` (a read: open to a read-only token). Trace links are built from
``$COALESCER_TRACE_URL``, read when the API starts."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.errors import InvalidKeyError, UnknownKeyError
from coalescer.query.timeline import parse_at
from coalescer.query.trace_links import ENV_TRACE_URL, check_template
from coalescer.web.requests import Refusal

TIMEOUT = 10.0  # seconds

ReadTimeline = Callable[..., Awaitable[dict[str, Any]]]  # Coalescer.query.timeline


def trace_url_from_env() -> str | None:
    """$COALESCER_TRACE_URL checked (ValueError naming what is wrong), or None."""
    value = os.environ.get(ENV_TRACE_URL) or None
    return None if value is None else check_template(value)


def _at(request: web.Request) -> int | None:
    text = request.query.get("at")
    if text is None:
        return None
    try:
        return parse_at(text)
    except ValueError as exc:
        raise Refusal(400, f"the query parameter 'at': {exc}", field="at") from None


async def timeline(request: web.Request, read: ReadTimeline,
                   trace_url: str | None) -> web.Response:
    """200 with the timeline; 400 for a bad ``at``; 404 for a key no rule matches; 422
    for a key that cannot be stored (too long); 503 when Redis cannot be read."""
    key = request.match_info["key"]
    at_ms = _at(request)
    try:
        async with asyncio.timeout(TIMEOUT):
            return web.json_response(await read(key, at_ms=at_ms, trace_url=trace_url))
    except UnknownKeyError:
        raise Refusal(404, f"no rule matches key {key!r}", key=key) from None
    except InvalidKeyError as exc:
        raise Refusal(422, str(exc), key=exc.key, invalid_keys=[
            {"key": exc.key, "error": exc.reason}]) from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise Refusal(503, f"cannot read the timeline of key {key!r} from Redis: "
                           f"{exc!r}") from None
