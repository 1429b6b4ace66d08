"""The namespace's shard layout as reads see it: which shards to read, and where a
key is while a reshard runs (its old shard until moved, then its new one)."""

from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.store import keys as key_names
from coalescer.store.keys import KeySpace
from coalescer.store.layout import LayoutInfo


async def read_layout(redis: Any, config: Config) -> LayoutInfo:
    """The layout in Redis (plain reads, nothing created); the rules file's count when
    the namespace has none yet."""
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(key_names.layout(config.namespace))
    pipe.smembers(key_names.drained(config.namespace))
    found, drained = await pipe.execute()
    if not found:
        return LayoutInfo(gen=0, shards=config.shards)
    number = {k: int(v) for k, v in found.items() if k != "by" and str(v).isdigit()}
    return LayoutInfo(gen=number.get("gen", 0), shards=number.get("shards", config.shards),
                      source=number.get("from", 0), began_ms=number.get("began", 0),
                      ended_ms=number.get("ended", 0), moved=number.get("moved", 0),
                      by=str(found.get("by", "")), was=number.get("was", 0),
                      drained=frozenset(int(n) for n in drained))


async def current_space(redis: Any, config: Config) -> KeySpace:
    """The key space to read: every shard of both counts while a reshard runs."""
    return (await read_layout(redis, config)).keyspace(config.namespace)


async def home_of(redis: Any, space: KeySpace, key: str) -> int:
    """The shard that holds ``key`` now: while a reshard runs, its old shard if that
    still holds it, else its new one."""
    homes = space.homes(key)
    if len(homes) == 1 or await redis.hexists(space.shard(homes[0]).meta, key):
        return homes[0]
    return homes[-1]


async def history_shards(redis: Any, config: Config, key: str | None) -> list[int]:
    """The shards whose history streams may hold ``key``'s refreshes (every key's, for
    None): where it lives now, and where it lived under the count the last reshard came
    from (an entry stays in the stream of the shard that ran it)."""
    info = await read_layout(redis, config)
    space = info.keyspace(config.namespace)
    past = KeySpace(config.namespace, info.was) if info.was and not space.resharding else None
    if key is None:
        return list(range(max(space.span, past.shards if past else 0)))
    homes = set(space.homes(key))
    if past is not None:
        homes.add(past.shard_of(key))
    return sorted(homes)
