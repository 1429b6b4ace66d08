"""A key's items across a live reshard's move, on a real server (store/lua/reshard_take.lua,
reshard_put.lua): the items of a failed try (a dead letter's, a retry's in backoff) stay
the items of a failed try in the new shard, so a touch with a time of its own there
(which replaces only the items touched since) leaves them for the next claim, as it does
in a shard the key never left."""

from __future__ import annotations

import pytest

from coalescer.store.keys import ShardKeys
from coalescer.store.layout import Layouts
from coalescer.store.script_types import ClaimedKey, Failure, UpsertGroup
from tests.store.test_scripts import LONG, RULE, Shard, shard  # noqa: F401 (shard: a fixture)

MAX = 4  # the rule's items max


async def touch(s: Shard, keys: ShardKeys, key: str, *, item: str | None = None,
                at: int | None = None) -> None:
    group = UpsertGroup(RULE, 0, 10 * LONG, [key],
                        items={key: [item]} if item else None, items_max=MAX,
                        schedules={key: f"a{at}"} if at is not None else None)
    assert await s.scripts.upsert(keys, [group]) == 1


async def claim(s: Shard, keys: ShardKeys, leader: str) -> ClaimedKey:
    batch = await s.scripts.claim(keys, leader=leader, node_id="n1", claim_lease_ms=LONG,
                                  sleep_cap_ms=1000, limits=[(RULE, 10)],
                                  item_rules={RULE: MAX})
    assert len(batch.claims) == 1, batch.claims
    return batch.claims[0]


async def failed_with_item(s: Shard, attempts: int) -> None:
    """Key "k" touched with item "i1", claimed (getting it) and failed: dead-lettered
    with one attempt allowed, else in a long backoff."""
    await s.lead()
    await touch(s, s.keys, "k", item="i1")
    first = await claim(s, s.keys, s.leader)
    assert first.items == ("i1",)
    retried, died, _ = await s.fail("k", first.token, attempts=attempts, delay=10 * LONG)
    assert (retried, died) == ((0, 1) if attempts == 1 else (1, 0))


async def moved(s: Shard) -> tuple[ShardKeys, str]:
    """Move "k" from shard 0 to shard 1 as a reshard's mover does; shard 1 and its
    leader lease."""
    new = ShardKeys(s.keys.namespace, 1)
    layouts = Layouts(s.scripts, s.keys.namespace, 1)
    taken = await layouts.take(s.keys, 2, ["k"], [1], [RULE])
    assert taken is not None and list(taken.bundles) == ["k"]
    assert await layouts.put(new, taken.seq, list(taken.bundles.values())) == 1
    lease = await s.scripts.acquire(new, node_id="n1", lease_ms=30_000, mine="")
    assert lease.granted
    return new, lease.holder


@pytest.mark.parametrize("move", [True, False], ids=["moved", "not moved"])
@pytest.mark.parametrize("attempts", [1, 3], ids=["dead letter", "retry in backoff"])
async def test_a_failed_trys_items_reach_the_next_claim_after_a_timed_touch_moved_or_not(
        shard: Shard, attempts: int, move: bool) -> None:  # noqa: F811
    await failed_with_item(shard, attempts)
    new, leader = await moved(shard) if move else (shard.keys, shard.leader)

    await touch(shard, new, "k", at=await shard.now() - 300)  # a time of its own: now

    again = await claim(shard, new, leader)
    assert again.items == ("i1",) or again.overflowed, again


async def test_a_failed_trys_items_reach_the_next_claim_after_a_move_and_a_plain_touch(
        shard: Shard) -> None:  # noqa: F811
    await failed_with_item(shard, 1)
    new, leader = await moved(shard)

    await touch(shard, new, "k", item="i2")

    again = await claim(shard, new, leader)
    assert again.items == ("i1", "i2")


async def test_a_timed_touch_in_the_new_shard_still_replaces_the_items_touched_since(
        shard: Shard) -> None:  # noqa: F811
    await failed_with_item(shard, 1)
    await touch(shard, shard.keys, "k", item="i2")  # revives it, with an item of its own
    await shard.fail("k", (await claim(shard, shard.keys, shard.leader)).token, attempts=1)
    await touch(shard, shard.keys, "k", item="i3")  # revives it again: i3 is pending
    new, leader = await moved(shard)

    await touch(shard, new, "k", at=await shard.now() - 300)

    again = await claim(shard, new, leader)
    assert again.items == ("i1", "i2")  # the failed tries' items, not the replaced i3


async def test_a_failed_trys_items_put_into_a_running_key_reach_its_next_claim(
        shard: Shard) -> None:  # noqa: F811
    await failed_with_item(shard, 1)
    new = ShardKeys(shard.keys.namespace, 1)
    lease = await shard.scripts.acquire(new, node_id="n1", lease_ms=30_000, mine="")
    await touch(shard, new, "k", item="i2")  # touched in its new shard before the put
    running = await claim(shard, new, lease.holder)
    assert running.items == ("i2",)
    layouts = Layouts(shard.scripts, shard.keys.namespace, 1)
    taken = await layouts.take(shard.keys, 2, ["k"], [1], [RULE])
    assert taken is not None
    assert await layouts.put(new, taken.seq, list(taken.bundles.values())) == 1

    await shard.scripts.ack(new, [(RULE, [("k", running.token)])], item_rules=[RULE])
    await touch(shard, new, "k")

    assert (await claim(shard, new, lease.holder)).items == ("i1",)


async def test_a_claim_gets_at_most_max_items_when_a_move_joins_two_failed_tries(
        shard: Shard) -> None:  # noqa: F811
    new = ShardKeys(shard.keys.namespace, 1)
    lease = await shard.scripts.acquire(new, node_id="n1", lease_ms=30_000, mine="")
    for n in range(MAX):  # touched in its new shard during the move: a try there fails
        await touch(shard, new, "k", item=f"j{n}")
    there = await claim(shard, new, lease.holder)
    await shard.scripts.fail(new, [(RULE, 3, [Failure("k", there.token, 10 * LONG, "boom")])])
    await shard.lead()  # and its last try in the old shard failed for good
    for n in range(MAX):
        await touch(shard, shard.keys, "k", item=f"i{n}")
    assert (await shard.fail("k", (await claim(shard, shard.keys, shard.leader)).token,
                             attempts=1))[1] == 1
    layouts = Layouts(shard.scripts, shard.keys.namespace, 1)
    taken = await layouts.take(shard.keys, 2, ["k"], [1], [RULE])
    assert taken is not None
    assert await layouts.put(new, taken.seq, list(taken.bundles.values())) == 1

    await touch(shard, new, "k", at=await shard.now() - 300)  # due now

    again = await claim(shard, new, lease.holder)
    assert len(again.items) == MAX and again.overflowed, again  # of the 8, told some went
