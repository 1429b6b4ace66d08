"""The copies of the paused rules kept in every shard's slot.

The namespace's paused set (``keys.paused_rules``) is what the nodes and the operator
read. The claim scripts cannot read it (in a Redis Cluster it lives on another slot), so
each shard keeps a copy (``ShardKeys.paused``) that ``claim.lua`` and ``adopt.lua`` read
in the same atomic step as they claim: once every shard's copy names a rule, no claim of
its keys is made, whatever a node that has not heard of the pause yet asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coalescer.store import keys as key_names
from coalescer.store.keys import ShardKeys


async def mark_paused(redis: Any, shards: Sequence[ShardKeys], rule: str, *,
                      paused: bool) -> None:
    """Add ``rule`` to (or remove it from) every copy in ``shards``, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for shard in shards:
        if paused:
            pipe.sadd(shard.paused, rule)
        else:
            pipe.srem(shard.paused, rule)
    await pipe.execute()


async def copy_paused(redis: Any, namespace: str, shards: Sequence[ShardKeys]) -> None:
    """Give ``shards`` (new ones: a reshard to more shards) every rule paused now."""
    rules = [str(r) for r in await redis.smembers(key_names.paused_rules(namespace))]
    if not rules:
        return
    pipe = redis.pipeline(transaction=False)
    for shard in shards:
        pipe.sadd(shard.paused, *rules)
    await pipe.execute()
