"""The next due keys: the earliest few pending keys of each rule, across every shard.

One pipelined round trip whatever the shard count (one per node on a cluster): the
head of every shard's due set of every rule, and the server clock to compare with.
A due-set score is a lower bound of the key's due time (a re-touch may have moved
it later); the page shows it as "due by".
"""

from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space

DEFAULT_SHOWN = 5
MAX_SHOWN = 100


async def next_due(redis: Any, config: Config, per_rule: int = DEFAULT_SHOWN) -> dict[str, Any]:
    """``{"now_ms", "rules": {RULE: [{"key", "due_ms", "shard"}, ...]}}``, earliest first."""
    if isinstance(per_rule, bool) or not 1 <= per_rule <= MAX_SHOWN:
        raise ValueError(f"the number of keys per rule must be 1 to {MAX_SHOWN}, got {per_rule!r}")
    space = await current_space(redis, config)
    names = [r.name for r in config.rules]
    pipe = redis.pipeline(transaction=False)
    for sk in space.all_shards():
        for name in names:
            pipe.zrange(sk.due(name), 0, per_rule - 1, withscores=True)
    pipe.time()
    *heads, (secs, micros) = await pipe.execute()
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    replies = iter(heads)
    for sk in space.all_shards():
        for name in names:
            found[name] += ({"key": str(key), "due_ms": int(score), "shard": sk.shard}
                            for key, score in next(replies))
    for keys in found.values():
        keys.sort(key=lambda k: (k["due_ms"], k["key"]))
        del keys[per_rule:]
    return {"now_ms": int(secs) * 1000 + int(micros) // 1000, "rules": found}
