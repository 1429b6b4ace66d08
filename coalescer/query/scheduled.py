"""The keys waiting for a time a touch set itself (``at``/``delay``), per rule: how many,
and the next one due. Read for ``coalescer status`` and the status page.

A scheduled key looks like any pending key in its rule's due set; only its state in
the shard's meta hash says so (an "S" in front, store/key_states.py). So the count is
an ``HSCAN`` of the shards' meta hashes, a page of every shard per round trip: at most
about ``SCAN_CAP`` states in all are looked at, and past that the count is a lower bound
(``scheduled_capped``).
"""

from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.errors import UnknownKeyError
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace

SCAN_CAP = 200_000  # states looked at in all, at most (the last round may pass it)
PAGE = 2000  # states per HSCAN call


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


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
    every shard is read or ``SCAN_CAP`` states were looked at in all."""
    for entry in rules.values():
        entry.update(scheduled=0, next_scheduled_ms=None, scheduled_capped=False)
    cursors = {sk.meta: 0 for sk in space.all_shards()}
    seen = 0
    while cursors and seen < SCAN_CAP:
        pipe = redis.pipeline(transaction=False)
        for meta, cursor in cursors.items():
            pipe.hscan(meta, cursor, count=PAGE)
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
