"""Per-rule counts read from a shard in a pipeline: pending, in flight, dead, next due.

Shared by `coalescer status` (the rules of the reader's file) and the registry's view
(rules only other nodes know).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from coalescer.store.keys import ShardKeys

DEAD_LISTED = 20  # dead letters listed per rule and shard (and in status overall)


def new_entry() -> dict[str, Any]:
    """A rule's counts before any shard is added."""
    return {"pending": 0, "in_flight": 0, "dead": 0, "next_due_ms": None}


def queue_rule(pipe: Any, sk: ShardKeys, name: str) -> None:
    """Queue the five reads of one rule on one shard (``read_rule`` takes their replies)."""
    pipe.zcard(sk.due(name))
    pipe.zcard(sk.inflight(name))
    pipe.zcard(sk.dead(name))
    pipe.zrange(sk.due(name), 0, 0, withscores=True)
    pipe.zrange(sk.dead(name), 0, DEAD_LISTED - 1, withscores=True)


def read_rule(entry: dict[str, Any], replies: Iterator[Any]) -> list[tuple[str, float]]:
    """Add one shard's replies for one rule to its entry; returns its listed dead keys."""
    entry["pending"] += int(next(replies))
    entry["in_flight"] += int(next(replies))
    entry["dead"] += int(next(replies))
    head = next(replies)
    if head and (entry["next_due_ms"] is None or head[0][1] < entry["next_due_ms"]):
        entry["next_due_ms"] = int(head[0][1])
    return [(str(key), float(since)) for key, since in next(replies)]
