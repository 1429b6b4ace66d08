"""The fair order of the claim script (store/lua/_fair.lua), on a real server: shapes a
tenant would check (one huge tenant against a trickle, balanced tenants, a lone tenant,
one tenant over many keys, more tenants than one claim batch), weights, the cap on a
tenant's runs in flight, and that a rule without ``fair`` keeps its due order."""

from __future__ import annotations

import re
from collections import Counter

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store.fair_args import FairSpec
from coalescer.store.fair_settings import FairChange, record_in_flight, write_overrides
from coalescer.store.keys import fair_runs
from coalescer.store.script_calls import script_source
from coalescer.store.script_types import ClaimBatch, UpsertGroup
from tests.store.test_scripts import LONG, Shard, shard  # noqa: F401 (shard: a fixture)

RULE = "t"
PATTERN = lua_pattern(KeyPattern.compile("t:{org}:{id}"), "org")


def spec(cap: int = 0, weights: dict[str, float] | None = None,
         priority_ms: int = 0) -> FairSpec:
    named = "\0".join(f"{v}\0{w!r}" for v, w in (weights or {}).items())
    return FairSpec(PATTERN, cap, named, priority_ms)


async def touch(s: Shard, *keys: str) -> None:
    for i in range(0, len(keys), 5000):
        part = keys[i:i + 5000]
        assert await s.scripts.upsert(s.keys, [UpsertGroup(RULE, 0, LONG, part)]) == len(part)


def keys_of(org: str, n: int, start: int = 0) -> list[str]:
    return [f"t:{org}:{i}" for i in range(start, start + n)]


async def claim(s: Shard, limit: int, fair: FairSpec | None = None) -> ClaimBatch:
    return await s.scripts.claim(s.keys, leader=s.leader, node_id="n1", claim_lease_ms=LONG,
                                 sleep_cap_ms=1000, limits=[(RULE, limit)],
                                 fair={RULE: fair} if fair else {})


def fair_constant(name: str) -> int:
    """One of the fair order's sizes, as the claim script has it."""
    found = re.search(r"local (FAIR_\w+(?:, FAIR_\w+)*) = ([\d, ]+)\n", script_source("claim"))
    assert found, "the claim script's fair sizes"
    sizes = dict(zip(found[1].split(", "), found[2].split(", "), strict=True))
    return int(sizes[name])


def orgs(batch: ClaimBatch) -> Counter[str]:
    return Counter(c.key.split(":")[1] for c in batch.claims)


async def test_a_trickle_tenant_is_claimed_in_the_first_batch_behind_a_huge_one(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("huge", 4000))
    await shard.after(await shard.now())
    await touch(shard, "t:quiet:1")  # due after every one of the huge tenant's keys
    await shard.after(await shard.now())

    batch = await claim(shard, 100, spec())

    assert orgs(batch) == {"huge": 99, "quiet": 1}


async def test_without_fair_the_same_trickle_waits_behind_the_whole_backlog(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("huge", 400))
    await shard.after(await shard.now())
    await touch(shard, "t:quiet:1")
    await shard.after(await shard.now())

    first = [await claim(shard, 100) for _ in range(4)]

    assert all(orgs(b) == {"huge": 100} for b in first)
    assert orgs(await claim(shard, 100)) == {"quiet": 1}


async def test_a_lone_tenant_drains_as_fast_and_in_due_order(shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    keys = keys_of("only", 50)
    for key in keys:
        await touch(shard, key)
    await shard.after(await shard.now())
    due_order = await shard.r.zrange(shard.keys.due(RULE), 0, -1)

    got = [c.key for _ in range(3) for c in (await claim(shard, 20, spec())).claims]

    assert got == due_order and len(got) == 50  # 20 + 20 + 10: every slot used, in order


async def test_balanced_tenants_share_each_batch_evenly(shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("a", 100), *keys_of("b", 100), *keys_of("c", 100))
    await shard.after(await shard.now())

    for _ in range(3):
        assert orgs(await claim(shard, 30, spec())) == {"a": 10, "b": 10, "c": 10}


async def test_weights_share_the_claims_of_backlogged_tenants(shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("a", 1500), *keys_of("b", 1500), *keys_of("c", 1500))
    await shard.after(await shard.now())

    total: Counter[str] = Counter()
    for _ in range(20):
        total += orgs(await claim(shard, 100, spec(weights={"a": 5, "b": 3, "c": 2})))

    assert sum(total.values()) == 2000
    assert abs(total["a"] - 1000) <= 2 and abs(total["b"] - 600) <= 2
    assert abs(total["c"] - 400) <= 2


async def test_one_tenant_over_many_keys_is_one_tenant(shard: Shard) -> None:  # noqa: F811
    await shard.lead()  # a sybil: 1,000 distinct keys, one org
    await touch(shard, *keys_of("sybil", 1000), *keys_of("honest", 10))
    await shard.after(await shard.now())

    assert orgs(await claim(shard, 20, spec())) == {"sybil": 10, "honest": 10}


async def test_more_tenants_than_one_batch_are_all_claimed_in_turn(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("big", 3000))
    await touch(shard, *(f"t:g{i}:1" for i in range(250)))
    await shard.after(await shard.now())

    seen: set[str] = set()
    for _ in range(6):  # 250 small tenants and one big one, 50 claims a call
        seen |= set(orgs(await claim(shard, 50, spec())))

    assert {f"g{i}" for i in range(250)} <= seen


async def test_a_cap_holds_each_tenants_runs_in_flight_until_one_finishes(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("a", 10), *keys_of("b", 10))
    await shard.after(await shard.now())

    first = await claim(shard, 8, spec(cap=2))
    assert orgs(first) == {"a": 2, "b": 2}
    again = await claim(shard, 8, spec(cap=2))
    assert again.claims == []
    assert again.blocked and again.held == {0: 16}  # they wait for a run to end

    done = next(c for c in first.claims if c.key.startswith("t:a:"))
    assert await shard.ack(done.key, done.token, rule=RULE) == []
    assert orgs(await claim(shard, 8, spec(cap=2))) == {"a": 1}
    runs = await shard.r.hgetall(fair_runs(shard.keys.namespace, RULE) + "a")
    assert len(runs) == 2  # the finished run's entry is gone


async def test_a_re_touched_key_is_not_claimed_before_its_new_due_time(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, "t:a:1", "t:a:2")
    await shard.after(await shard.now())
    assert await claim(shard, 0, spec()) is not None  # nothing claimed, nothing indexed
    first = await claim(shard, 1, spec())  # indexes both, claims t:a:1
    assert [c.key for c in first.claims] == ["t:a:1"]
    n = await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, LONG, 10 * LONG, ["t:a:2"])])
    assert n == 1  # its due time moves a minute on

    assert (await claim(shard, 10, spec())).claims == []


async def claim_one_of_two_indexed(s: Shard) -> None:
    """t:a:1 and t:a:2 due, both indexed by a claim that took t:a:1 only."""
    await s.lead()
    await touch(s, "t:a:1", "t:a:2")
    await s.after(await s.now())
    assert [c.key for c in (await claim(s, 1, spec())).claims] == ["t:a:1"]


async def test_a_cancelled_key_left_in_the_index_is_never_claimed(
        shard: Shard) -> None:  # noqa: F811
    await claim_one_of_two_indexed(shard)
    await shard.r.zrem(shard.keys.due(RULE), "t:a:2")  # as a cancel leaves it
    await shard.r.hdel(shard.keys.meta, "t:a:2")

    assert (await claim(shard, 10, spec())).claims == []


async def test_a_key_a_drain_took_after_it_was_indexed_is_not_claimed_again(
        shard: Shard) -> None:  # noqa: F811
    await claim_one_of_two_indexed(shard)
    _, taken = await shard.scripts.take(shard.keys, node_id="drain", claim_lease_ms=LONG,
                                        limits=[(RULE, 10)])
    assert [c.key for c in taken] == ["t:a:2"]  # running now, its index entry left over

    assert (await claim(shard, 10, spec())).claims == []


async def test_a_due_key_whose_state_was_lost_is_claimed_as_touched_now(
        shard: Shard) -> None:  # noqa: F811
    await claim_one_of_two_indexed(shard)
    await shard.r.hdel(shard.keys.meta, "t:a:2")  # by hand: due:t still holds it

    assert [c.key for c in (await claim(shard, 10, spec())).claims] == ["t:a:2"]


async def test_a_trickle_due_in_the_same_millisecond_as_a_huge_backlog_is_reached(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()  # one write: its keys share one due time; t:m:1 sorts amid them
    await claim(shard, 10, spec())  # (a claim before: the fast lane looks at new keys only)
    beyond_fast_lane = fair_constant("FAIR_FAST") + 1000
    keys = [*keys_of("aaa", 3000), "t:m:1", *keys_of("zzz", beyond_fast_lane)]
    assert await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, 0, LONG, keys)]) == len(keys)
    await shard.after(await shard.now())
    scores = await shard.r.zrange(shard.keys.due(RULE), 0, -1, withscores=True)
    assert len({score for _, score in scores}) == 1

    first, second = await claim(shard, 10, spec()), await claim(shard, 10, spec())

    # the fast lane's newest keys are zzz keys (64 of them indexed), the sweep reads
    # 2,000 a call, and the rest of that millisecond is the lane's gap, which reaches
    # t:m:1 at once: the first call claims it, inside the same millisecond
    assert orgs(first) == {"aaa": 5, "m": 1, "zzz": 4}
    assert "m" not in orgs(second)
    # and the sweep, cut inside that millisecond call after call, indexes every key once
    claimed = [c.key for c in first.claims + second.claims]
    while batch := (await claim(shard, 1000, spec())).claims:
        claimed += [c.key for c in batch]
    assert sorted(claimed) == sorted(keys)


async def backlog_then_quiet_key(s: Shard) -> None:
    """A backlog many calls deep (the catch-up sweep far behind), one claim of it, then
    a quiet tenant's key."""
    await s.lead()
    await touch(s, *keys_of("huge", 20_000))
    await s.after(await s.now())
    assert orgs(await claim(s, 10, spec())) == {"huge": 10}
    await touch(s, "t:quiet:1")
    await s.after(await s.now())


async def test_a_trickle_falling_due_behind_a_backlog_is_indexed_at_the_next_call(
        shard: Shard) -> None:  # noqa: F811
    await backlog_then_quiet_key(shard)

    assert orgs(await claim(shard, 10, spec())) == {"huge": 9, "quiet": 1}


async def test_a_trickle_key_just_before_a_write_larger_than_the_fast_lane_is_not_left_behind(
        shard: Shard) -> None:  # noqa: F811
    await backlog_then_quiet_key(shard)  # then, later, more keys than the lane reads
    await touch(shard, *keys_of("huge", fair_constant("FAIR_FAST") + 500, start=20_000))
    await shard.after(await shard.now())

    first, second = await claim(shard, 10, spec()), await claim(shard, 10, spec())

    # the lane reads the newest keys first, the write's, and then what they hid (the
    # gap), however far behind the sweep is
    assert (orgs(first) + orgs(second))["quiet"] == 1


async def test_keys_hidden_by_two_writes_larger_than_the_fast_lane_are_each_looked_at_once(
        shard: Shard) -> None:  # noqa: F811
    async def write(*keys: str) -> None:
        await touch(shard, *keys)
        await shard.after(await shard.now())  # the next write falls due later

    fast, gap = fair_constant("FAIR_FAST"), fair_constant("FAIR_GAP")
    await backlog_then_quiet_key(shard)  # quiet:1, then a write the first call cannot finish
    await write(*keys_of("huge", fast + gap + 1000, start=20_000))
    first = await claim(shard, 10, spec())
    await write("t:quiet:2")  # and another write larger than the lane before the next call
    await write(*keys_of("huge", fast + 100, start=40_000))
    second = await claim(shard, 10, spec())

    # the second call reads its own gap (quiet:2) and goes on with what is left of the
    # first write's, down to quiet:1; it does not read again the keys between the two
    # gaps, which the first call's lane read
    assert (orgs(first) + orgs(second))["quiet"] == 2


async def test_a_burst_falling_due_faster_than_one_call_indexes_loses_no_key(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await claim(shard, 10, spec())  # the index is up to date: nothing due
    await touch(shard, "t:first:1")
    await touch(shard, *keys_of("huge", 9000))  # due after t:first:1, more than one call
    await shard.after(await shard.now())

    claimed: Counter[str] = Counter()
    for _ in range(12):
        claimed += orgs(await claim(shard, 1000, spec()))
    assert claimed == {"huge": 9000, "first": 1}


async def test_weights_and_a_cap_set_at_runtime_hold_for_the_next_claim(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("a", 300), *keys_of("b", 300))
    await shard.after(await shard.now())
    assert orgs(await claim(shard, 20, spec(weights={"a": 3}))) == {"a": 15, "b": 5}

    await write_overrides(shard.r, shard.keys.namespace, [shard.keys], RULE,
                          FairChange(weights={"b": 3, "a": 1}))
    total = orgs(await claim(shard, 40, spec(weights={"a": 3})))
    assert abs(total["b"] - 30) <= 1 and abs(total["a"] - 10) <= 1

    await write_overrides(shard.r, shard.keys.namespace, [shard.keys], RULE,
                          FairChange(cap=3, reset=True))
    assert orgs(await claim(shard, 40, spec(weights={"a": 3}))) == {"a": 3, "b": 3}


async def test_a_cap_set_at_runtime_counts_the_runs_already_going(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await touch(shard, *keys_of("a", 20))
    await shard.after(await shard.now())
    assert orgs(await claim(shard, 5, spec())) == {"a": 5}  # no cap: not recorded

    await write_overrides(shard.r, shard.keys.namespace, [shard.keys], RULE,
                          FairChange(cap=6))
    found = await record_in_flight(shard.r, shard.keys.namespace, [shard.keys], RULE,
                                   lambda key: key.split(":")[1])
    assert found == 5
    assert orgs(await claim(shard, 10, spec())) == {"a": 1}


async def test_an_adopting_node_claims_in_fair_order_under_the_cap(
        shard: Shard) -> None:  # noqa: F811
    await shard.r.set(shard.keys.leader, "1|leader")  # a leader that lacks the rule
    await shard.r.hset(shard.keys.rules, mapping={"leader": "|other=a|", "n2": f"|{RULE}=a|"})
    await touch(shard, *keys_of("huge", 500))
    await shard.after(await shard.now())
    await touch(shard, "t:quiet:1")
    await shard.after(await shard.now())

    batch = await shard.scripts.adopt(shard.keys, node_id="n2", claim_lease_ms=LONG,
                                      limits=[(RULE, 10)], fair={RULE: spec(cap=4)})

    assert batch.served == 1
    assert Counter(c.key.split(":")[1] for c in batch.claims) == {"huge": 4, "quiet": 1}
    assert batch.blocked  # the capped tenant's keys wait for a run to end


async def test_a_key_put_back_below_the_sweep_point_is_found_behind_capped_tenants(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()  # two capped tenants' backlogs sit below the sweep point
    await touch(shard, *keys_of("a", 300), *keys_of("b", 300))
    await shard.after(await shard.now())
    assert orgs(await claim(shard, 10, spec(cap=1))) == {"a": 1, "b": 1}
    # a key put back with a due time as old as theirs, ranked after all of them (as an
    # ack re-arms a touch that came while it ran), which no sweep indexes
    await touch(shard, "t:c:1")
    last_key, last_score = (await shard.r.zrange(shard.keys.due(RULE), -2, -2,
                                                  withscores=True))[0]
    assert last_key.startswith("t:b:")
    await shard.r.zadd(shard.keys.due(RULE), {"t:c:1": last_score})
    await shard.r.delete(shard.keys.fair(RULE) + "q:c")

    found: Counter[str] = Counter()
    for _ in range(40):  # a round, 16 keys a call, over the 599 below the sweep point
        found += orgs(await claim(shard, 10, spec(cap=1)))
    assert found == {"c": 1}
