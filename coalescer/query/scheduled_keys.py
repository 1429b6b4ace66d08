"""The keys waiting for a time a touch set itself (``at``/``delay``), listed with their
times, soonest first (``coalescer scheduled``, ``Query.scheduled_keys``).

A scheduled key sits in its rule's due set like any pending key; only its state says
so (an "S" in front, store/key_states.py). Each shard's due set of each rule is read
from its start a page at a time (``ZRANGE`` by rank, then ``HMGET`` of the page's
states), until ``limit`` scheduled keys were found there or ``SCAN_CAP`` keys were
looked at: never a blocking scan. Past the cap (many plain keys due before the
scheduled ones), ``capped`` says the list may miss some.
"""

from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space
from coalescer.store import key_states as states
from coalescer.store.keys import ShardKeys

PAGE = 1000  # due-set entries per round trip
SCAN_CAP = 100_000  # entries of one due set looked at, at most
MAX_SHOWN = 10_000


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


async def _of_shard(redis: Any, sk: ShardKeys, rule: str,
                    limit: int) -> tuple[list[dict[str, Any]], bool]:
    """The first ``limit`` scheduled keys of ``rule`` in one shard, and whether the cap
    stopped the read first."""
    found: list[dict[str, Any]] = []
    start = 0
    while len(found) < limit:
        if start >= SCAN_CAP:
            return found, True
        page = await redis.zrange(sk.due(rule), start, start + PAGE - 1)
        if not page:
            break
        values = await redis.hmget(sk.meta, page)
        for key, value in zip(page, values, strict=True):
            text = _text(value) if value is not None else ""
            pending = states.pending(text) if text.startswith("S") else None
            if pending is not None and pending.scheduled:
                found.append({"key": _text(key), "rule": rule, "due_ms": pending.due_ms,
                              "shard": sk.shard})
        if len(page) < PAGE:
            break
        start += PAGE
    return found, False


async def scheduled_keys(redis: Any, config: Config, rule: str | None = None,
                         limit: int = 20) -> dict[str, Any]:
    """``{"now_ms", "keys": [{"key", "rule", "due_ms", "shard"}, ...], "capped"}``: the
    ``limit`` soonest scheduled keys (of ``rule``, else of every rule). KeyError for a
    rule ``config`` lacks, ValueError for a limit out of 1..MAX_SHOWN."""
    names = [r.name for r in config.rules]
    if rule is not None and rule not in names:
        raise KeyError(rule)
    if isinstance(limit, bool) or not 1 <= limit <= MAX_SHOWN:
        raise ValueError(f"the number of keys must be 1 to {MAX_SHOWN}, got {limit!r}")
    space = await current_space(redis, config)
    keys: list[dict[str, Any]] = []
    capped = False
    for sk in space.all_shards():
        for name in [rule] if rule is not None else names:
            found, cut = await _of_shard(redis, sk, name, limit)
            keys += found
            capped = capped or cut
    keys.sort(key=lambda k: (k["due_ms"], k["key"]))
    secs, micros = await redis.time()
    return {"now_ms": int(secs) * 1000 + int(micros) // 1000, "keys": keys[:limit],
            "capped": capped}
