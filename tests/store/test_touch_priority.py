"""A touch's own priority, on a real server: kept in the key's pending state (the largest
of its burst's touches, dropped once claimed), and the claim order it gives among due
keys (store/lua/upsert.lua, _fair.lua): ahead of keys due a little earlier, never before
its own due time, never more than its offset ahead of its place in due order."""

from __future__ import annotations

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store import key_states as states
from coalescer.store.fair_args import FairSpec
from coalescer.store.keys import ShardKeys
from coalescer.store.layout import Layouts
from coalescer.store.script_types import ClaimBatch, Failure, UpsertGroup
from tests.store.test_scripts import LONG, Shard, shard  # noqa: F401 (shard: a fixture)

RULE = "t"
ONE_GROUP = FairSpec("", 0, "", 0)  # a rule with a priority: and no fair:
BY_ORG = FairSpec(lua_pattern(KeyPattern.compile("t:{org}:{id}"), "org"), 0, "", 0)


async def touch(s: Shard, *keys: str, priority_ms: int | None = None, window: int = 0,
                spec: str = "") -> None:
    times = {k: f"{spec}p{priority_ms}" for k in keys} if priority_ms is not None else (
        {k: spec for k in keys} if spec else None)
    group = UpsertGroup(RULE, window, 10 * LONG, keys, schedules=times)
    assert await s.scripts.upsert(s.keys, [group]) == len(keys)


async def claim(s: Shard, limit: int, fair: FairSpec | None = ONE_GROUP) -> ClaimBatch:
    return await s.scripts.claim(s.keys, leader=s.leader, node_id="n1", claim_lease_ms=LONG,
                                 sleep_cap_ms=1000, limits=[(RULE, limit)],
                                 fair={RULE: fair} if fair else {})


def claimed(batch: ClaimBatch) -> list[str]:
    return [c.key for c in batch.claims]


async def priority_of(s: Shard, key: str) -> int:
    value = await s.state(key)
    assert value is not None
    pending = states.pending(value)
    assert pending is not None, value
    return pending.priority_ms


async def test_a_key_touched_with_a_priority_is_claimed_before_keys_due_earlier(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1", "t:a:2", "t:a:3")
    await shard.after(await shard.now())
    await touch(shard, "t:a:low", priority_ms=5_000)
    await touch(shard, "t:a:high", priority_ms=60_000)
    await shard.after(await shard.now())

    assert claimed(await claim(shard, 2)) == ["t:a:high", "t:a:low"]
    assert claimed(await claim(shard, 5)) == ["t:a:1", "t:a:2", "t:a:3"]


async def test_without_a_priority_rule_the_claim_keeps_due_order(shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1")
    await shard.after(await shard.now())
    await touch(shard, "t:a:2", priority_ms=60_000)  # kept, but the plain path reads none
    await shard.after(await shard.now())

    assert claimed(await claim(shard, 1, fair=None)) == ["t:a:1"]


async def test_a_high_priority_key_due_later_waits_for_its_due_time(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:later", priority_ms=86_400_000, window=LONG)
    await touch(shard, "t:a:now")
    await shard.after(await shard.now())

    assert claimed(await claim(shard, 10)) == ["t:a:now"]
    assert await shard.r.zscore(shard.keys.due(RULE), "t:a:later") is not None


async def test_no_key_is_overtaken_by_one_due_later_than_its_own_due_time_plus_the_offset(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:old")
    old_due = await shard.now()
    await shard.after(old_due + 100)  # what comes now is due over 100 ms after it
    await touch(shard, "t:a:slightly", priority_ms=50)  # offset too small to pass it
    await touch(shard, "t:a:much", priority_ms=10_000)  # well within its offset
    await shard.after(await shard.now())

    assert claimed(await claim(shard, 3)) == ["t:a:much", "t:a:old", "t:a:slightly"]


async def test_inside_a_fair_group_priority_orders_the_groups_keys_not_the_groups(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1", "t:a:2", "t:b:1", "t:b:2")
    await shard.after(await shard.now())
    await touch(shard, "t:a:urgent", priority_ms=60_000)
    await shard.after(await shard.now())

    first = claimed(await claim(shard, 2, BY_ORG))

    assert first == ["t:a:urgent", "t:b:1"]  # one claim each; a's first is its urgent key


async def test_the_rules_priority_and_a_touchs_priority_count_the_larger(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1")
    await shard.after(await shard.now())
    await touch(shard, "t:a:2", priority_ms=1)  # less than the rule's 60 s: the rule's
    await touch(shard, "t:a:3")
    await shard.after(await shard.now())

    rule_wide = FairSpec("", 0, "", 60_000)  # every key 60 s: due order again
    assert claimed(await claim(shard, 3, rule_wide)) == ["t:a:1", "t:a:2", "t:a:3"]


async def test_a_burst_keeps_its_largest_priority_until_it_is_claimed(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1", priority_ms=10_000, window=LONG)
    await touch(shard, "t:a:1", priority_ms=5_000, window=LONG)
    assert await priority_of(shard, "t:a:1") == 10_000
    await touch(shard, "t:a:1", window=LONG)  # a plain touch keeps it
    assert await priority_of(shard, "t:a:1") == 10_000
    await touch(shard, "t:a:1", priority_ms=20_000, window=LONG, spec="d0")  # a time too
    assert await priority_of(shard, "t:a:1") == 20_000
    await shard.after(await shard.now())

    (done,) = (await claim(shard, 1)).claims
    assert await shard.ack(done.key, done.token, rule=RULE) == []
    await touch(shard, "t:a:1", window=LONG)  # a new burst starts without one

    assert await priority_of(shard, "t:a:1") == 0


async def test_a_priority_costs_a_pending_key_at_most_8_bytes(shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:plain", window=LONG)
    await touch(shard, "t:a:most", window=LONG, priority_ms=366 * 86_400_000)

    plain, most = await shard.state("t:a:plain"), await shard.state("t:a:most")
    assert plain is not None and most is not None
    assert len(most) - len(plain) <= 8
    assert await priority_of(shard, "t:a:most") == 366 * 86_400_000


async def test_a_touch_while_the_key_runs_keeps_its_priority_for_the_re_arm(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1")
    await shard.after(await shard.now())
    (running,) = (await claim(shard, 1)).claims
    await touch(shard, "t:a:1", priority_ms=7_000)  # while it runs
    await touch(shard, "t:a:1", priority_ms=3_000)
    value = await shard.state("t:a:1")
    assert value is not None and value.startswith("R|")

    assert await shard.ack(running.key, running.token, rule=RULE) == []

    assert await priority_of(shard, "t:a:1") == 7_000  # the re-arm's, the larger


async def test_a_failed_run_retries_with_the_priority_touched_while_it_ran(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1")
    await shard.after(await shard.now())
    (running,) = (await claim(shard, 1)).claims
    await touch(shard, "t:a:1", priority_ms=9_000)

    retried, died, _ = await shard.scripts.fail(
        shard.keys, [(RULE, 3, [Failure(running.key, running.token, 0, "boom")])])

    assert (retried, died) == (1, [])
    assert await priority_of(shard, "t:a:1") == 9_000
    assert await shard.r.zscore(shard.keys.due(RULE), "t:a:1") is not None


async def test_a_reshard_moves_a_keys_priority_with_it_and_a_merge_keeps_the_larger(
        shard: Shard) -> None:  # noqa: F811
    await touch(shard, "t:a:1", priority_ms=12_000, window=LONG)
    await touch(shard, "t:a:2", priority_ms=4_000, window=LONG)
    new = ShardKeys(shard.keys.namespace, 1)
    group = UpsertGroup(RULE, LONG, 10 * LONG, ["t:a:2"], schedules={"t:a:2": "p9000"})
    assert await shard.scripts.upsert(new, [group]) == 1  # touched there while it moved
    layouts = Layouts(shard.scripts, shard.keys.namespace, 1)

    taken = await layouts.take(shard.keys, 2, ["t:a:1", "t:a:2"], [1, 1], [RULE])
    assert taken is not None
    assert await layouts.put(new, taken.seq, list(taken.bundles.values())) == 2

    moved = {k: states.pending(str(await shard.r.hget(new.meta, k))) for k in ("t:a:1", "t:a:2")}
    assert {k: p.priority_ms for k, p in moved.items() if p} == {"t:a:1": 12_000,
                                                                 "t:a:2": 9_000}
