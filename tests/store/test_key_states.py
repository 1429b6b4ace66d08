"""Reading a key's state as the scripts store it in its shard's meta hash."""

from __future__ import annotations

from redis.asyncio import Redis

from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts


def test_a_key_touched_once_reads_first_touch_and_due_time() -> None:
    p = states.pending("18e2a4c1f00|500")
    assert p == states.Pending(first_ms=0x18E2A4C1F00, last_ms=0x18E2A4C1F00, attempts=0,
                               due_ms=0x18E2A4C1F00 + 500)


def test_last_touch_and_attempts_are_offsets_and_counts() -> None:
    p = states.pending("10|900|250|3")
    assert p == states.Pending(first_ms=16, last_ms=266, attempts=3, due_ms=916)


def test_a_burst_of_several_touches_reads_its_count() -> None:
    assert states.pending("10|900|250|0|3") == states.Pending(
        first_ms=16, last_ms=266, attempts=0, due_ms=916, touches=3)
    assert states.pending("Sg|1o|5|0|2") == states.Pending(
        first_ms=16, last_ms=21, attempts=0, due_ms=76, scheduled=True, touches=2)


def test_the_older_pending_form_still_reads() -> None:
    p = states.pending("P|1000|1200|2|1700")
    assert p == states.Pending(first_ms=1000, last_ms=1200, attempts=2, due_ms=1700)


def test_kinds() -> None:
    assert states.kind(None) == "idle"
    assert states.kind("R|7|1|1|1|1||||node") == "running"
    assert states.kind("D|1|1|3|boom") == "dead"
    assert states.kind("18e2a4c1f00|500") == "pending"


def test_unreadable_values_are_not_pending_states() -> None:
    assert states.pending("not|a|state") is None
    assert states.pending("18e2a4c1f00") is None


async def test_what_the_scripts_write_reads_back(redis_client: Redis, namespace: str) -> None:
    shard = KeySpace(namespace, 1).shard(0)
    await Scripts(redis_client).upsert(shard, [UpsertGroup("r", 500, 5000, ["k"])])
    value = str(await redis_client.hget(shard.meta, "k"))
    p = states.pending(value)
    assert p is not None and p.attempts == 0 and p.first_ms == p.last_ms
    assert p.due_ms == p.first_ms + 500
    assert len(value) <= 16  # short: a pending key stays small in Redis memory


async def test_each_write_of_a_touch_counts_once_in_the_burst(redis_client: Redis,
                                                              namespace: str) -> None:
    shard = KeySpace(namespace, 1).shard(0)
    scripts = Scripts(redis_client)
    for _ in range(3):
        await scripts.upsert(shard, [UpsertGroup("r", 500, 5000, ["k"])])
    value = str(await redis_client.hget(shard.meta, "k"))
    p = states.pending(value)
    assert p is not None and p.touches == 3 and p.attempts == 0
    assert len(value) <= 24
