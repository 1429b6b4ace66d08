"""The fair order of the claim script (store/lua/_fair.lua), on a real server: shapes a
tenant would check (one huge tenant against a trickle, balanced tenants, a lone tenant,
one tenant over many keys, more tenants than one claim batch), weights, the cap on a
tenant's runs in flight, and that a rule without ``fair`` keeps its due order."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store.fair_args import FairSpec
from coalescer.store.fair_settings import FairChange, record_in_flight, write_overrides
from coalescer.store.keys import fair_runs
from coalescer.store.script_calls import script_source
from coalescer.store.script_types import ClaimBatch, Failure, UpsertGroup
from tests.helpers.servers import ValkeyProcess
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


async def lead(s: Shard, fair: FairSpec | None = None) -> None:
    """Lead the shard and claim once in fair order (nothing is due): that first claim
    publishes the rule's order, so every write from then on is indexed as it is made."""
    await s.lead()
    assert (await claim(s, 1, fair or spec())).claims == []


def fair_constant(name: str) -> int:
    """One of the fair order's sizes, as the claim script has it."""
    sizes: dict[str, str] = {}
    for names, values in re.findall(r"local (FAIR_\w+(?:, FAIR_\w+)*) = ([\d, ]+)\n",
                                    script_source("claim")):
        sizes |= zip(names.split(", "), values.split(", "), strict=True)
    return int(sizes[name])


def orgs(batch: ClaimBatch) -> Counter[str]:
    return Counter(c.key.split(":")[1] for c in batch.claims)


async def test_a_trickle_tenant_is_claimed_in_the_first_batch_behind_a_huge_one(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("huge", 4000))
    await shard.after(await shard.now())
    await touch(shard, "t:quiet:1")  # due after every one of the huge tenant's keys
    await shard.after(await shard.now())

    batch = await claim(shard, 100, spec())

    assert orgs(batch) == {"huge": 99, "quiet": 1}
    # and among the first to start, in the order the claims were picked
    assert [c.key for c in batch.claims].index("t:quiet:1") == 1


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
    await lead(shard)
    keys = keys_of("only", 50)
    for key in keys:
        await touch(shard, key)
    await shard.after(await shard.now())
    due_order = await shard.r.zrange(shard.keys.due(RULE), 0, -1)

    got = [c.key for _ in range(3) for c in (await claim(shard, 20, spec())).claims]

    assert got == due_order and len(got) == 50  # 20 + 20 + 10: every slot used, in order


PER_KEY = ("zpopmin", "zmscore")  # a claim taking keys one by one pops, then looks up


@pytest.fixture
async def counted_shard(own_server: ValkeyProcess, namespace: str) -> AsyncIterator[Shard]:
    """A led shard whose fair order is published, on a server of the test's own (its
    command counts are the test's alone), with tenant a's 100 keys due."""
    client = Redis.from_url(own_server.url, decode_responses=True)
    try:
        s = Shard(client, namespace)
        await lead(s)
        await touch(s, *keys_of("a", 100))
        await s.after(await s.now())
        yield s
    finally:
        await client.aclose()


async def lookups_of_claims(s: Shard, server: ValkeyProcess, limit: int,
                            calls: int) -> tuple[Counter[str], int]:
    """Claim ``calls`` times in fair order: the commands of a claim taking keys one by
    one those claims sent, counted by the server, and how many keys they claimed."""
    sync = server.client()
    try:
        sync.config_resetstat()
        claimed = sum([len((await claim(s, limit, spec())).claims) for _ in range(calls)])
        stats = sync.info("commandstats")
    finally:
        sync.close()
    return Counter({name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
                    for name in PER_KEY}), claimed


async def test_a_lone_tenants_claims_cut_its_queue_and_the_due_keys_by_rank(
        counted_shard: Shard, own_server: ValkeyProcess) -> None:
    s = counted_shard
    due_order = await s.r.zrange(s.keys.due(RULE), 0, -1)

    counted, claimed = await lookups_of_claims(s, own_server, 32, 3)

    assert claimed == 96 and counted["zpopmin"] == 0, counted  # one tenant: by rank
    assert await s.r.zrange(s.keys.due(RULE), 0, -1) == due_order[96:]
    assert await s.r.zrange(s.keys.fair(RULE) + "q:a", 0, -1) == due_order[96:]


async def test_a_tenant_whose_queue_and_due_keys_differ_is_claimed_key_by_key(
        counted_shard: Shard, own_server: ValkeyProcess) -> None:
    s = counted_shard
    first = (await s.r.zrange(s.keys.due(RULE), 0, 0))[0]
    await s.r.zrem(s.keys.due(RULE), first)  # as a cancel leaves it in the queue
    await s.r.hdel(s.keys.meta, first)

    counted, claimed = await lookups_of_claims(s, own_server, 10, 1)

    assert counted["zpopmin"] == 1  # the queue's head is gone: key by key
    assert claimed == 9  # the nine others the call popped
    assert await s.r.zscore(s.keys.fair(RULE) + "q:a", first) is None


async def test_balanced_tenants_share_each_batch_evenly(shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 100), *keys_of("b", 100), *keys_of("c", 100))
    await shard.after(await shard.now())

    for _ in range(3):
        assert orgs(await claim(shard, 30, spec())) == {"a": 10, "b": 10, "c": 10}


async def test_weights_share_the_claims_of_backlogged_tenants(shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 1500), *keys_of("b", 1500), *keys_of("c", 1500))
    await shard.after(await shard.now())

    total: Counter[str] = Counter()
    for _ in range(20):
        total += orgs(await claim(shard, 100, spec(weights={"a": 5, "b": 3, "c": 2})))

    assert sum(total.values()) == 2000
    assert abs(total["a"] - 1000) <= 2 and abs(total["b"] - 600) <= 2
    assert abs(total["c"] - 400) <= 2


async def test_one_tenant_over_many_keys_is_one_tenant(shard: Shard) -> None:  # noqa: F811
    await lead(shard)  # a sybil: 1,000 distinct keys, one org
    await touch(shard, *keys_of("sybil", 1000), *keys_of("honest", 10))
    await shard.after(await shard.now())

    assert orgs(await claim(shard, 20, spec())) == {"sybil": 10, "honest": 10}


async def test_more_tenants_than_one_batch_are_all_claimed_in_turn(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("big", 3000))
    await touch(shard, *(f"t:g{i}:1" for i in range(250)))
    await shard.after(await shard.now())

    seen: set[str] = set()
    for _ in range(6):  # 250 small tenants and one big one, 50 claims a call
        seen |= set(orgs(await claim(shard, 50, spec())))

    assert {f"g{i}" for i in range(250)} <= seen


async def test_a_cap_holds_each_tenants_runs_in_flight_until_one_finishes(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
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
    await lead(shard)
    await touch(shard, "t:a:1", "t:a:2")
    await shard.after(await shard.now())
    first = await claim(shard, 1, spec())  # both indexed, t:a:1 claimed
    assert [c.key for c in first.claims] == ["t:a:1"]
    n = await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, LONG, 10 * LONG, ["t:a:2"])])
    assert n == 1  # its due time moves a minute on

    assert (await claim(shard, 10, spec())).claims == []


async def test_a_re_touched_key_a_capped_claim_put_back_holds_no_run_of_its_tenant(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 2), *keys_of("b", 2))
    await shard.after(await shard.now())
    moved = await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, LONG, 10 * LONG,
                                                                 ["t:a:0"])])
    assert moved == 1  # its due time moves a minute on; its due score stays early

    batch = await claim(shard, 8, spec(cap=5))

    assert sorted(c.key for c in batch.claims) == ["t:a:1", "t:b:0", "t:b:1"]
    for org in ("a", "b"):
        runs = await shard.r.hgetall(fair_runs(shard.keys.namespace, RULE) + org)
        assert runs == {c.key: f"{c.token}|{shard.keys.meta}" for c in batch.claims
                        if c.key.startswith(f"t:{org}:")}


async def claim_one_of_two_indexed(s: Shard) -> None:
    """t:a:1 and t:a:2 due, both indexed by a claim that took t:a:1 only."""
    await lead(s)
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
    await lead(shard)  # one write: its keys share one due time; t:m:1 sorts amid them
    keys = [*keys_of("aaa", 3000), "t:m:1", *keys_of("zzz", 11_000)]
    assert await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, 0, LONG, keys)]) == len(keys)
    await shard.after(await shard.now())
    scores = await shard.r.zrange(shard.keys.due(RULE), 0, -1, withscores=True)
    assert len({score for _, score in scores}) == 1

    first = await claim(shard, 10, spec())

    assert orgs(first) == {"aaa": 5, "m": 1, "zzz": 4}
    claimed = [c.key for c in first.claims]
    while batch := (await claim(shard, 1000, spec())).claims:
        claimed += [c.key for c in batch]
    assert sorted(claimed) == sorted(keys)  # every key once


async def test_keys_written_before_the_first_fair_claim_are_all_indexed_from_the_due_set(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()  # no fair claim yet: the writes are not indexed as they are made
    sweep = fair_constant("FAIR_SWEEP")
    await touch(shard, *keys_of("huge", 2 * sweep))
    await shard.after(await shard.now())
    await touch(shard, "t:quiet:1")  # due after every one of the huge tenant's keys
    await shard.after(await shard.now())

    calls = [orgs(await claim(shard, 10, spec())) for _ in range(3)]

    # the first claim builds the index from the due set, FAIR_SWEEP keys a call in due
    # order: the quiet key is reached at the third call, and claimed there
    assert calls[:2] == [{"huge": 10}, {"huge": 10}]
    assert calls[2] == {"huge": 9, "quiet": 1}
    claimed = sum(calls, Counter())
    while batch := await claim(shard, 1000, spec()):
        if not batch.claims:
            break
        claimed += orgs(batch)
    assert claimed == {"huge": 2 * sweep, "quiet": 1}


async def test_a_tenant_whose_keys_fall_due_later_gets_no_credit_for_the_wait(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 300))
    await shard.after(await shard.now())
    n = await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, 300, LONG, keys_of("b", 50))])
    assert n == 50  # b's keys fall due in 300 ms: written now, due later
    b_due = int((await shard.r.zscore(shard.keys.due(RULE), "t:b:0")) or 0)
    served = [orgs(await claim(shard, 5, spec())) for _ in range(4)]
    assert served == [{"a": 5}] * 4  # a alone meanwhile: the virtual time moves on
    await shard.after(b_due)

    # b joins the order when its keys fall due, level with a: no burst for the wait
    assert orgs(await claim(shard, 10, spec())) == {"a": 5, "b": 5}


async def backlog_then_quiet_key(s: Shard) -> None:
    """A backlog many calls deep (the catch-up sweep far behind), one claim of it, then
    a quiet tenant's key."""
    await lead(s)
    await touch(s, *keys_of("huge", 20_000))
    await s.after(await s.now())
    assert orgs(await claim(s, 10, spec())) == {"huge": 10}
    await touch(s, "t:quiet:1")
    await s.after(await s.now())


async def test_a_trickle_falling_due_behind_a_backlog_is_indexed_at_the_next_call(
        shard: Shard) -> None:  # noqa: F811
    await backlog_then_quiet_key(shard)

    assert orgs(await claim(shard, 10, spec())) == {"huge": 9, "quiet": 1}


async def test_a_burst_falling_due_faster_than_one_call_indexes_loses_no_key(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
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
    await lead(shard)
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
    await lead(shard)
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


async def test_a_key_missing_from_its_queue_is_found_by_the_round_behind_capped_tenants(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 300), *keys_of("b", 300))
    await shard.after(await shard.now())
    assert orgs(await claim(shard, 10, spec(cap=1))) == {"a": 1, "b": 1}
    # a due key ranked after all of theirs that its queue lacks (as a writer older than
    # the queues leaves it)
    await touch(shard, "t:c:1")
    last_key, last_score = (await shard.r.zrange(shard.keys.due(RULE), -2, -2,
                                                  withscores=True))[0]
    assert last_key.startswith("t:b:")
    await shard.r.zadd(shard.keys.due(RULE), {"t:c:1": last_score})
    await shard.r.delete(shard.keys.fair(RULE) + "q:c")

    found: Counter[str] = Counter()
    every, low = fair_constant("FAIR_EVERY"), fair_constant("FAIR_LOW")
    for _ in range(every * (599 // low + 2)):  # a round over the 599 keys due
        found += orgs(await claim(shard, 10, spec(cap=1)))
    assert found == {"c": 1}


async def test_a_rule_claimed_without_fair_drops_its_queues_and_its_writes_are_not_queued(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await touch(shard, *keys_of("a", 5))
    assert await indexed(shard)
    await shard.after(await shard.now())

    assert orgs(await claim(shard, 2)) == {"a": 2}  # a node whose rules lost `fair:`
    await touch(shard, *keys_of("b", 5))

    assert await indexed(shard) == {}
    assert await shard.r.hlen(shard.keys.fair_specs) == 0
    assert orgs(await claim(shard, 100)) == {"a": 3, "b": 5}


async def test_the_writers_copy_of_the_order_lost_to_eviction_is_back_within_a_round(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await shard.r.delete(shard.keys.fair_specs)  # as an eviction would
    await shard.touch("t:a:1", window=LONG // 2, rule=RULE)
    assert await indexed(shard) == {}  # the writers no longer index

    for _ in range(fair_constant("FAIR_EVERY")):
        assert (await claim(shard, 1, spec())).claims == []
    await shard.touch("t:b:1", window=LONG // 2, rule=RULE)

    assert await shard.r.hlen(shard.keys.fair_specs) == 1
    assert set(await indexed(shard)) == {"t:a:1", "t:b:1"}  # t:a:1 by the claims


async def indexed(s: Shard) -> dict[str, float]:
    """Every key in the rule's queues, with its score there."""
    prefix = s.keys.fair(RULE)
    groups = {*await s.r.zrange(prefix + "groups", 0, -1),
              *await s.r.zrange(prefix + "heads", 0, -1)}
    out: dict[str, float] = {}
    for group in groups:
        out |= dict(await s.r.zrange(prefix + "q:" + group, 0, -1, withscores=True))
    return out


async def test_every_script_that_makes_a_key_pending_puts_it_in_its_queue_at_its_due_time(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    await shard.touch("t:a:1", "t:a:2", "t:a:3", "t:c:1", rule=RULE)
    await shard.touch("t:b:1", window=5000, rule=RULE)  # not due yet
    await shard.after(await shard.now())
    running = {c.key: c.token for c in (await claim(shard, 4, spec())).claims}
    assert set(running) == {"t:a:1", "t:a:2", "t:a:3", "t:c:1"}
    await shard.touch("t:a:1", rule=RULE)  # while it runs: its ack re-arms it
    await shard.ack("t:a:1", running["t:a:1"], rule=RULE)
    await shard.scripts.fail(shard.keys, [  # one retried later; one dead, then brought back
        (RULE, 3, [Failure("t:a:2", running["t:a:2"], 800, "boom")]),
        (RULE, 1, [Failure("t:a:3", running["t:a:3"], 0, "boom")])])
    assert await shard.scripts.requeue(shard.keys, RULE, ["t:a:3"]) == 1
    assert await shard.scripts.run_now(shard.keys, RULE, "t:b:1") == "hastened"

    due = dict(await shard.r.zrange(shard.keys.due(RULE), 0, -1, withscores=True))
    assert set(due) == {"t:a:1", "t:a:2", "t:a:3", "t:b:1"}  # t:c:1 still runs
    assert await indexed(shard) == due


async def test_a_key_due_beyond_the_look_ahead_is_indexed_only_when_it_comes_near(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    ahead = fair_constant("FAIR_AHEAD")  # (the look-ahead reads again once a step on)
    await shard.touch("t:a:1", window=ahead + fair_constant("FAIR_STEP") + 300, rule=RULE)
    due = int(await shard.r.zscore(shard.keys.due(RULE), "t:a:1") or 0)
    assert await indexed(shard) == {}  # a key due later costs no index while it waits

    await shard.after(due - ahead)
    assert (await claim(shard, 10, spec())).claims == []

    assert await indexed(shard) == {"t:a:1": due}


async def test_after_the_clock_stepped_back_the_look_ahead_reads_from_the_new_horizon(
        shard: Shard) -> None:  # noqa: F811
    await lead(shard)
    ahead, step = fair_constant("FAIR_AHEAD"), fair_constant("FAIR_STEP")
    now = await shard.now()  # a claim made 10 minutes on left its mark there
    await shard.r.hset(shard.keys.fair(RULE) + "state", "ahead", f"{now + ahead + 600_000}|")
    await shard.touch("t:a:1", window=ahead + step + 300, rule=RULE)
    due = int(await shard.r.zscore(shard.keys.due(RULE), "t:a:1") or 0)
    assert (await claim(shard, 10, spec())).claims == []

    await shard.after(due - ahead)
    assert (await claim(shard, 10, spec())).claims == []

    assert await indexed(shard) == {"t:a:1": due}
