"""``GET /rules/{rule}/fair``: a fair rule's weights and cap in force; ``POST
/rules/{rule}/fair`` with ``{"weights": {"VALUE": W}, "max_running": N, "reset": false}``
changes them at runtime (``coalescer fair RULE``): every node's next claim follows, no
restart. ``max_running`` 0 lifts the cap; a field left out is left as it is. The POST
goes through the API's token and cross-site guards, and is audited."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.common.audit_log import operator_action
from coalescer.common.json_depth import TooDeep, loads_bounded
from coalescer.common.printable import printable
from coalescer.query.fair_controls import NotFairError, checked_change, fair_view, set_fair
from coalescer.store.fair_settings import FairChange
from coalescer.web.requests import Refusal

TIMEOUT = 10.0
_FIELDS = ("weights", "max_running", "reset")
_SHAPE = ('send {"weights": {"VALUE": WEIGHT}, "max_running": N (0: no cap), "reset": '
          'false}, any of them')


def _change(raw: bytes) -> FairChange:
    try:
        body = loads_bounded(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TooDeep) as exc:
        raise Refusal(400, f"the body is not a JSON object: {exc}; {_SHAPE}") from None
    if not isinstance(body, dict):
        raise Refusal(400, f"the body must be a JSON object; {_SHAPE}")
    extra = sorted(set(body) - set(_FIELDS))
    if extra:
        raise Refusal(400, f"unknown field {extra[0]!r}; {_SHAPE}", field=extra[0])
    weights = body.get("weights", {})
    if not isinstance(weights, dict):
        raise Refusal(400, f"'weights' must be an object of value -> weight; {_SHAPE}",
                      field="weights")
    reset = body.get("reset", False)
    if not isinstance(reset, bool):
        raise Refusal(400, "'reset' must be true or false", field="reset")
    try:
        return checked_change(weights, body.get("max_running"), reset)
    except NotFairError as exc:
        raise Refusal(400, str(exc)) from None


async def fair_settings(request: web.Request, c: Any, body: bytes | None,
                        who: str) -> web.Response:
    """200 with the settings in force of the coalescer ``c``'s rule (after the change,
    for a POST with ``body``); 404 for no such rule, 409 for a rule without ``fair:``,
    400 naming what is wrong with a body (nothing is changed then)."""
    rule = request.match_info["rule"]
    redis, config, sink = c.redis, c.config, c.audit
    change = None if body is None else _change(body)
    try:
        async with asyncio.timeout(TIMEOUT):
            if change is None:
                view = await fair_view(redis, config, rule)
            else:
                view = await set_fair(redis, config, rule, change)
    except KeyError:
        names = [r.name for r in config.rules]
        raise Refusal(404, f"no rule named {rule!r}", rule=rule, rules=names) from None
    except NotFairError as exc:
        raise Refusal(409, str(exc), rule=rule) from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise Refusal(503, f"cannot read or change rule {rule!r}'s fair settings in Redis: "
                           f"{exc!r}") from None
    if change is not None:
        operator_action("fair", f"rule {printable(rule)}", 1, who, sink=sink,
                        detail=json.dumps(view.to_json()))
    return web.json_response(view.to_json())
