"""``GET /keys/{key}/timeline[?at=T]``: the JSON of ``coalescer timeline KEY [--at T]
--json`` (a read: open to a read-only token). Trace links are built from
``$COALESCER_TRACE_URL``, read when the API starts."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from coalescer.query.timeline import parse_at
from coalescer.query.trace_links import ENV_TRACE_URL, check_template
from coalescer.web.requests import Refusal, key_read_refusals

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
    with key_read_refusals(key, f"the timeline of key {key!r}"):
        async with asyncio.timeout(TIMEOUT):
            found = await read(key, at_ms=at_ms, trace_url=trace_url)
    return web.json_response(found)
