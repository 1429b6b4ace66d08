"""``DELETE /rules/{rule}/scheduled?after=TIME``: cancel in bulk the keys of a rule
scheduled (``at``/``delay``) after a time, as ``coalescer cancel --rule R
--scheduled-after TIME`` does (write/cancel_scheduled.py), and say how many."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.errors import ClosedError, InvalidScheduleError, shown_key
from coalescer.web.requests import Refusal

TIMEOUT = 120.0  # seconds a bulk cancel may take (it is paged: many round trips)

CancelScheduled = Callable[..., Awaitable[int]]  # Coalescer.cancel_scheduled


async def cancel_scheduled(request: web.Request, cancel: CancelScheduled, rules: list[str],
                           who: str) -> web.Response:
    """200 ``{"rule", "after", "dry_run", "cancelled": N}``; 404 for no such rule, 400
    naming ``after`` when it is missing or cannot be read (nothing is cancelled)."""
    rule = request.match_info["rule"]
    after = request.query.get("after")
    dry_run = request.query.get("dry_run", "") in ("1", "true")
    if rule not in rules:
        raise Refusal(404, f"no rule named {rule!r}", rule=rule, rules=rules)
    if not after:
        raise Refusal(400, "the query parameter 'after' is missing: the keys scheduled after "
                           "that time (ISO-8601 with an offset, or epoch seconds) are "
                           "cancelled; nothing was cancelled", field="after")
    try:
        async with asyncio.timeout(TIMEOUT):
            done = await cancel(rule, after=after, dry_run=dry_run, who=who)
    except InvalidScheduleError as exc:
        raise Refusal(400, f"after {shown_key(after)} cannot be used: {exc.reason}; nothing "
                           "was cancelled", field="after") from None
    except ClosedError as exc:
        raise Refusal(503, f"the node is not running: {exc}") from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise Refusal(503, f"cannot cancel the scheduled keys of rule {rule!r} in Redis "
                           f"(some may be cancelled): {exc!r}") from None
    body: dict[str, Any] = {"rule": rule, "after": after, "dry_run": dry_run,
                            "cancelled": done}
    return web.json_response(body)
