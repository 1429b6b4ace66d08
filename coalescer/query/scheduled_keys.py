"""The keys waiting for a time a touch set itself (``at``/``delay``): listed with their
times, soonest first (``coalescer scheduled``, ``Query.scheduled_keys``), and counted per
rule with the next one due (``coalescer status``, the status page).

A scheduled key sits in its rule's due set like any pending key; only its state in the
shard's meta hash says so (an "S" in front, store/key_states.py). A list reads each
shard's due set of each rule from its start a page at a time (``ZRANGE`` by rank, then
``HMGET`` of the page's states) until ``limit`` scheduled keys were found there or
``SCAN_CAP`` keys were looked at; a count is an ``HSCAN`` of the shards' meta hashes, a
page of every shard per round trip, until ``COUNT_CAP`` states were looked at in all.
Never a blocking scan: past a cap, ``capped`` (``scheduled_capped``) says the list may
miss some (the count is a lower bound).
"""
from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.errors import UnknownKeyError
from coalescer.query.layout_read import current_space
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace, ShardKeys

PAGE = 1000  # due-set entries per round trip
SCAN_CAP = 100_000  # entries of one due set looked at, at most
MAX_SHOWN = 10_000
COUNT_CAP = 200_000  # states a count looks at in all, at most (the last round may pass it)
COUNT_PAGE = 2000  # states per HSCAN call of a count


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


def _count(rules: dict[str, dict[str, Any]], config: Config, key: str, due_ms: int) -> None:
    try:
        name = config.rule_for(key).name
    except UnknownKeyError:  # a key of rules this file no longer has
        return
    entry = rules.get(name)
    if entry is None:
        return
    entry["scheduled"] += 1
    if entry["next_scheduled_ms"] is None or due_ms < entry["next_scheduled_ms"]:
        entry["next_scheduled_ms"] = due_ms


def _count_page(page: dict[Any, Any], config: Config,
                rules: dict[str, dict[str, Any]]) -> None:
    for key, value in page.items():
        text = _text(value)
        if text.startswith("S"):
            found = states.pending(text)
            if found is not None:
                _count(rules, config, _text(key), found.due_ms)


async def add_scheduled(redis: Any, config: Config, space: KeySpace,
                        rules: dict[str, dict[str, Any]]) -> None:
    """Add ``scheduled``, ``next_scheduled_ms`` and ``scheduled_capped`` to each rule's
    entry of ``rules``: one pipelined ``HSCAN`` page of every shard a round trip, until
    every shard is read or ``COUNT_CAP`` states were looked at in all."""
    for entry in rules.values():
        entry.update(scheduled=0, next_scheduled_ms=None, scheduled_capped=False)
    cursors = {sk.meta: 0 for sk in space.all_shards()}
    seen = 0
    while cursors and seen < COUNT_CAP:
        pipe = redis.pipeline(transaction=False)
        for meta, cursor in cursors.items():
            pipe.hscan(meta, cursor, count=COUNT_PAGE)
        replies = await pipe.execute()
        for meta, (cursor, page) in zip(list(cursors), replies, strict=True):
            _count_page(page, config, rules)
            seen += len(page)
            if int(cursor) == 0:
                del cursors[meta]
            else:
                cursors[meta] = int(cursor)
    if cursors:
        for entry in rules.values():
            entry["scheduled_capped"] = True
