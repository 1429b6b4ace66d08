"""Re-queueing dead-lettered keys (`coalescer retry`, G6)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from .keys import KeySpace
from .rules import Config
from .scripts import Scripts

BATCH = 500


async def requeue_dead(redis: Any, scripts: Scripts, config: Config,
                       keys: Iterable[str] | None) -> int:
    """Re-queue the given dead keys, or every dead key when ``keys`` is None."""
    space = KeySpace(config.namespace, config.shards)
    if keys is not None:
        groups: dict[tuple[int, str], list[str]] = defaultdict(list)
        for key in keys:
            groups[(space.shard_of(key), config.match(key)[0].name)].append(key)
        total = 0
        for (shard, rule), group in groups.items():
            total += await scripts.requeue(space.shard(shard), rule, group)
        return total
    return await _requeue_all(redis, scripts, config, space)


async def _requeue_all(redis: Any, scripts: Scripts, config: Config, space: KeySpace) -> int:
    total = 0
    for sk in space.all_shards():
        for rule in config.rules:
            while batch := await redis.zrange(sk.dead(rule.name), 0, BATCH - 1):
                n = await scripts.requeue(sk, rule.name, batch)
                total += n
                if n == 0:
                    break
    return total
