"""The state a leading rule keeps past a key's refresh: its quiet marker (the key's last
touch, ``NS:{NS:N}:quiet:KEY``), through the real scripts on a real server. It expires
a window after the last touch, the byte quota counts it, and a purge deletes it (a
cancel's is in test_leading_edge.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
import redis.asyncio

from coalescer.store.byte_count import ByteCount
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

KEY_OVERHEAD = 80  # bytes of Redis's own a key counts for (pending_bytes.lua)


@pytest_asyncio.fixture
async def r(redis_url: str) -> AsyncIterator[Any]:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


def group(key: str, leading: bool) -> UpsertGroup:
    return UpsertGroup("lead", 5000, 10000, [key], leading=leading)


async def added(r: Any, shard: ShardKeys) -> int:
    return int(await r.hget(shard.bytes, "added") or 0)


async def test_a_leading_touch_keeps_the_marker_a_window_and_counts_its_bytes(
        r: Any, namespace: str) -> None:
    shard, scripts = KeySpace(namespace, 1).shard(0), Scripts(r)
    await scripts.upsert(shard, [group("a:1", leading=False)])
    trailing = await added(r, shard)
    assert await r.exists(shard.quiet("a:1")) == 0  # a trailing rule keeps none
    await scripts.upsert(shard, [group("a:2", leading=True)])
    marker = shard.quiet("a:2")
    assert 0 < await r.pttl(marker) <= 5000  # gone a window after the last touch
    state = await r.hget(shard.meta, "a:2")  # due at its first touch: "FIRST|0"
    assert state.endswith("|0")
    own = 2 * len("a:2") + len(state) + KEY_OVERHEAD  # what a trailing rule's key adds
    assert await added(r, shard) - trailing == own + len(marker) + 16 + KEY_OVERHEAD


async def test_the_byte_count_of_a_leading_rule_counts_its_markers(
        r: Any, namespace: str) -> None:
    shard, scripts = KeySpace(namespace, 1).shard(0), Scripts(r)
    await scripts.upsert(shard, [group("a:1", leading=True)])
    without, _ = await ByteCount(r, items=False, traces=False).count(shard)
    await r.delete(shard.bytes)
    with_markers, _ = await ByteCount(r, items=False, traces=False, leading=True).count(shard)
    assert with_markers - without == await r.memory_usage(shard.quiet("a:1")) > 0


async def test_a_purge_of_a_dead_key_deletes_its_marker(r: Any, namespace: str) -> None:
    shard, scripts = KeySpace(namespace, 1).shard(0), Scripts(r)
    await scripts.upsert(shard, [group("a:1", leading=True)])
    await r.hset(shard.meta, "a:1", "D|1|1|5|boom")  # as fail.lua leaves a dead key
    await r.zrem(shard.due("lead"), "a:1")
    await r.zadd(shard.dead("lead"), {"a:1": 1})
    assert await r.exists(shard.quiet("a:1")) == 1
    assert await scripts.purge(shard, "lead", ["a:1"]) == (1, [])
    assert await r.exists(shard.quiet("a:1")) == 0
