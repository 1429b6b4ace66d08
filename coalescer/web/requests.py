"""What a request to a node's HTTP API must be: its content type, a JSON body of keys,
keys Redis can store; and ``Refusal``, the error answer a bad request gets.

Shared by the API's routes and the status page's endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from aiohttp import web
from redis.exceptions import RedisError

from coalescer.common.json_depth import TooDeep, loads_bounded
from coalescer.common.plural import noun, plural
from coalescer.config.model import Rule
from coalescer.config.priority import priority_ms
from coalescer.config.schedule import HORIZON, schedule_spec
from coalescer.errors import (
    InvalidKeyError,
    InvalidPriorityError,
    InvalidScheduleError,
    UnknownKeyError,
    shown_key,
)
from coalescer.store.keycheck import unstorable_keys, unstorable_message

SHOWN_KEYS = 100  # unknown keys listed in a 422 answer at most
MAX_NUMBER_DIGITS = 100  # a longer JSON number is refused before Python converts it


class Refusal(Exception):
    """A request answered with an error status and a JSON body ``{"error": ..., **extra}``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": message, **extra}
        self.close = False  # answer with "Connection: close"
        self.headers: dict[str, str] = {}  # more headers of the answer (Retry-After)

    def response(self) -> web.Response:
        response = web.json_response(self.body, status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


# --- /touch body validation ------------------------------------------------------------


_SHAPE = 'the body must be a JSON object {"keys": ["KEY", ...]}'


def _no_constant(name: str) -> Any:
    raise Refusal(400, f"malformed JSON: {name} is not a JSON value")


def _int(digits: str) -> int:
    if len(digits) > MAX_NUMBER_DIGITS:
        raise Refusal(400, f"malformed JSON: a number of {len(digits)} digits")
    return int(digits)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise Refusal(400, f"malformed JSON: the field {name!r} appears twice")
        out[name] = value
    return out


def _decode(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refusal(400, f"the body is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise Refusal(400, f"empty body; {_SHAPE}")
    try:
        return loads_bounded(text, parse_constant=_no_constant, parse_int=_int,
                             object_pairs_hook=_object)
    except TooDeep as exc:
        raise Refusal(400, f"malformed JSON: nested too deeply, {exc}") from None
    except json.JSONDecodeError as exc:
        raise Refusal(400, f"malformed JSON: {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from None
    except RecursionError:
        raise Refusal(400, f"malformed JSON: nested too deeply; {_SHAPE}") from None


def _check_key(index: int, key: object) -> str:
    if not isinstance(key, str):
        raise Refusal(400, f"keys[{index}] must be a string, got {type(key).__name__}")
    if not key:
        raise Refusal(400, f"keys[{index}] is an empty string; keys must not be empty")
    return key


def parse_keys(raw: bytes) -> list[str]:
    """The keys of a /touch body; Refusal(400) saying what is wrong with it."""
    body = _decode(raw)
    if not isinstance(body, dict):
        raise Refusal(400, f"{_SHAPE}, got a JSON {type(body).__name__}")
    extra = sorted(set(body) - {"keys"})
    if extra:
        raise Refusal(400, f"unknown {noun(len(extra), 'field')} {', '.join(map(repr, extra))}; "
                           f"{_SHAPE}")
    if "keys" not in body:
        raise Refusal(400, f"the field 'keys' is missing; {_SHAPE}")
    keys = body["keys"]
    if not isinstance(keys, list):
        raise Refusal(400, f"'keys' must be a list of strings, got {type(keys).__name__}")
    return [_check_key(i, key) for i, key in enumerate(keys)]


_TOUCH_SHAPE = ('the body must be a JSON object {"keys": ["KEY", ...]}, '
                '{"items": [["KEY", "ITEM"], ...]} or both, and at most one of "at" '
                '(epoch seconds or ISO-8601 with an offset) and "delay" (seconds or "30m")')
TIME_FIELDS = ("at", "delay")
PRIORITY_FIELD = "priority"  # seconds or a duration string: see Coalescer.touch


def _check_pair(index: int, pair: object) -> tuple[str, str]:
    if not isinstance(pair, list) or len(pair) != 2:
        got = f"a list of {len(pair)}" if isinstance(pair, list) else type(pair).__name__
        raise Refusal(400, f"items[{index}] must be a [KEY, ITEM] pair of strings, got {got}")
    key, item = pair
    for part, value in (("0", key), ("1", item)):
        if not isinstance(value, str):
            raise Refusal(400, f"items[{index}][{part}] must be a string, got "
                               f"{type(value).__name__}")
    if not key:
        raise Refusal(400, f"items[{index}][0] is an empty string; keys must not be empty")
    return key, item


def parse_touch(raw: bytes) -> tuple[list[str], list[tuple[str, str]], dict[str, Any]]:
    """The plain keys, the (key, item) touches and the time (``at`` or ``delay``, as
    given, and ``priority``; empty for none) of a /touch body; Refusal(400) saying what
    is wrong with it.
    Either of keys and items may be left out, not both."""
    body = _decode(raw)
    if not isinstance(body, dict):
        raise Refusal(400, f"{_TOUCH_SHAPE}, got a JSON {type(body).__name__}")
    extra = sorted(set(body) - {"keys", "items", *TIME_FIELDS, PRIORITY_FIELD})
    if extra:
        raise Refusal(400, f"unknown {noun(len(extra), 'field')} {', '.join(map(repr, extra))}; "
                           f"{_TOUCH_SHAPE}")
    if "keys" not in body and "items" not in body:
        raise Refusal(400, f"the field 'keys' is missing (or 'items'); {_TOUCH_SHAPE}")
    keys = body.get("keys", [])
    if not isinstance(keys, list):
        raise Refusal(400, f"'keys' must be a list of strings, got {type(keys).__name__}")
    pairs = body.get("items", [])
    if not isinstance(pairs, list):
        raise Refusal(400, f"'items' must be a list of [KEY, ITEM] pairs, got "
                           f"{type(pairs).__name__}")
    when = {name: body[name] for name in (*TIME_FIELDS, PRIORITY_FIELD)
            if body.get(name) is not None}
    return ([_check_key(i, key) for i, key in enumerate(keys)],
            [_check_pair(i, pair) for i, pair in enumerate(pairs)], when)


def refuse_bad_time(when: dict[str, Any], keys: list[str], ahead: float = HORIZON) -> None:
    """Refuse (400) a /touch body whose ``at``/``delay`` cannot be used (before 1970,
    more than ``ahead`` seconds ahead, ...), naming it."""
    when = {name: when[name] for name in TIME_FIELDS if name in when}
    if not when:
        return
    try:
        schedule_spec(keys[0] if keys else "", **when, ahead=ahead)
    except InvalidScheduleError as exc:
        field = "at" if "at" in when and "delay" not in when else (
            "delay" if "at" not in when else "at, delay")
        raise Refusal(400, f"{field} {shown_key(exc.value)} cannot be used: {exc.reason}; nothing "
                           "was touched", field=field) from None


def refuse_bad_priority(when: dict[str, Any], keys: list[str],
                        rule_for: Callable[[str], Rule]) -> None:
    """Refuse (400) a /touch body whose ``priority`` cannot be used for one of ``keys``
    (each matching a rule), naming the field, the key and why."""
    if PRIORITY_FIELD not in when:
        return
    try:
        for key in keys:
            priority_ms(key, when[PRIORITY_FIELD], rule_for(key))
    except InvalidPriorityError as exc:
        raise Refusal(400, f"priority {shown_key(exc.value)} cannot be used for key "
                           f"{shown_key(exc.key)}: {exc.reason}; nothing was touched",
                      field=PRIORITY_FIELD) from None


def refuse_bad_items(bad: list[dict[str, Any]]) -> None:
    """Refuse (422) a request whose (key, item) touches cannot be made (``bad``: index,
    key, item and error of each), listing the first few."""
    if bad:
        first = bad[0]
        raise Refusal(422, f"{plural(len(bad), 'item')} cannot be touched (items"
                           f"[{first['index']}]: {first['error']}); nothing was touched",
                      invalid_items=bad[:SHOWN_KEYS])


def refuse_unstorable(keys: list[str], *, undone: str = "touched",
                      first: Literal["index", "none"] = "index") -> None:
    """Refuse (422) a request naming keys Redis cannot store, listing the first few."""
    bad = unstorable_keys(keys)
    if bad:
        raise Refusal(422, unstorable_message(bad, undone=undone, first=first),
                      invalid_keys=[{"index": b.index, "key": b.key, "error": b.problem}
                                    for b in bad[:SHOWN_KEYS]])


_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")


def check_content_type(request: web.Request) -> None:
    """Refuse (415) a JSON body declared in another charset than UTF-8 (its type,
    application/json, is checked before: ``coalescer.web.guards.json_body_guard``)."""
    charset = request.charset
    if charset is not None and charset.lower() not in _CHARSETS:
        raise Refusal(415, f"the body must be UTF-8 JSON, not {charset}")


def unreadable(request: web.Request, exc: Exception) -> Refusal:
    """A body that cannot be decoded: answer, then close the connection (its framing is
    lost) without reading the rest of it (aiohttp would meet the same error again)."""
    why = " ".join(str(exc).split()).removeprefix("400, message: ")
    refusal = Refusal(400, f"the body cannot be read: {why}")
    refusal.close = True
    request.content.feed_eof()
    return refusal


@contextmanager
def key_read_refusals(key: str, what: str) -> Iterator[None]:
    """A failed read of ``key`` as its HTTP answer: 404 for a key no rule matches, 422
    for one that cannot be stored, 503 naming ``what`` when Redis cannot be read."""
    try:
        yield
    except UnknownKeyError:
        raise Refusal(404, f"no rule matches key {key!r}", key=key) from None
    except InvalidKeyError as exc:
        raise Refusal(422, str(exc), key=exc.key, invalid_keys=[
            {"key": exc.key, "error": exc.reason}]) from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise Refusal(503, f"cannot read {what} from Redis: {exc!r}") from None
