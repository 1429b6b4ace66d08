"""Reading a sorted set a page at a time from where the page before ended (a rule's
per-shard set, for the key search and the bulk actions): plain ``ZRANGE`` by rank,
checked against the entry the page before ended on; ``keys_start.lua`` (registered once
per client) finds the rank again when entries before it came or went.

An entry is (member, score); the set's order is score, then the member's bytes. A page
after the entry ``after`` = (score, member, rank) reads the ranks ``rank`` to ``rank +
count`` in one call and keeps what follows ``after`` when the first entry read is
``after`` or sorts before it and the second after it. Otherwise (entries before it were
removed or added since) the script gives the rank right after ``after`` and the read is
made again from there, checked the same way, a few times at most; past that the page
drops what does not sort after ``after``, so a page never repeats an entry, and an entry
that stayed in the set is missed only if entries before it kept moving during every one
of those reads."""

from __future__ import annotations

import weakref
from typing import Any

from coalescer.store.script_calls import script_source

TRIES = 4  # reads of one page before it is taken as read
_registered: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

Entry = tuple[str, str]  # (member, score as text)
After = tuple[str, str, int]  # (score as text, member, its rank when read)


def _script(redis: Any) -> Any:
    script = _registered.get(redis)
    if script is None:
        script = _registered[redis] = redis.register_script(script_source("keys_start"))
    return script


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _order(member: str, score: float) -> tuple[float, bytes]:
    return score, member.encode("utf-8", "surrogatepass")


def _score_text(score: float) -> str:
    return repr(float(score))


async def _read(redis: Any, set_key: str, start: int, count: int) -> list[tuple[str, float]]:
    found = await redis.zrange(set_key, start, start + count - 1, withscores=True)
    return [(_text(m), float(s)) for m, s in found]


def _follows(got: list[tuple[str, float]], start: int, after: tuple[float, bytes]) -> bool:
    """Whether the read from rank ``start - 1`` (``got``) sits right after ``after``."""
    if start > 0 and (not got or _order(*got[0]) > after):
        return False
    rest = got[1:] if start > 0 else got
    return not rest or _order(*rest[0]) > after


async def set_page(redis: Any, set_key: str, after: After | None,
                   count: int) -> tuple[list[Entry], int]:
    """Up to ``count`` entries of the sorted set ``set_key``, in its order, right after
    ``after`` (None: from the start), and the rank of the first of them."""
    if after is None:
        return [(m, _score_text(s)) for m, s in await _read(redis, set_key, 0, count)], 0
    score, member, rank = after
    key = _order(member, float(score))
    start = rank + 1
    got: list[tuple[str, float]] = []
    follows = False
    for _ in range(TRIES):
        got = await _read(redis, set_key, max(0, start - 1), count + (1 if start > 0 else 0))
        if follows := _follows(got, start, key):
            break
        start = int(await _script(redis)(keys=[set_key], args=[score, member]))
    rest = got[1:] if start > 0 and got else got
    if not follows:  # still moving: keep only what sorts after ``after``
        rest = [(m, s) for m, s in rest if _order(m, s) > key]
    return [(m, _score_text(s)) for m, s in rest[:count]], max(0, start)
