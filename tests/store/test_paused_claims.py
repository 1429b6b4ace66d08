"""The claim scripts read the shard's own copy of the paused rules: a caller that asks
for a paused rule's keys (a node that has not heard of the pause) claims none of them;
once the copy no longer names the rule, they are claimed. On a Redis Cluster, pause
writes the copy of every shard, each in its own shard's slot."""

from __future__ import annotations

from coalescer import Coalescer
from coalescer.store.claim_scripts import NO_ITEM_RULES
from coalescer.store.keys import KeySpace
from coalescer.store.paused_copies import mark_paused
from coalescer.store.script_types import AdoptBatch
from tests.conftest import RulesFactory
from tests.helpers.servers import Cluster
from tests.store.test_scripts import Shard, shard  # noqa: F401 (shard: a fixture)

PAUSED, OTHER = "paused-rule", "other-rule"

CLUSTER_RULES = """\
namespace: {ns}
shards: 6
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: handlers:refresh
"""


async def test_a_claim_asking_for_a_paused_rule_claims_none_of_its_keys(
        shard: Shard) -> None:  # noqa: F811
    await shard.lead()
    await shard.touch("p1", "p2", "p3", rule=PAUSED)
    await shard.touch("o1", rule=OTHER)
    await mark_paused(shard.r, [shard.keys], PAUSED, paused=True)

    batch = await shard.claim(limits=[(PAUSED, 100), (OTHER, 100)])

    assert [c.key for c in batch.claims] == ["o1"]
    assert await shard.r.zcard(shard.keys.due(PAUSED)) == 3
    assert await shard.r.zcard(shard.keys.inflight(PAUSED)) == 0
    assert not batch.blocked  # its due keys hold nothing up and do not wake the poller
    assert batch.next_due_ms is None

    await mark_paused(shard.r, [shard.keys], PAUSED, paused=False)
    resumed = await shard.claim(limits=[(PAUSED, 100), (OTHER, 100)])
    assert sorted(c.key for c in resumed.claims) == ["p1", "p2", "p3"]


async def test_an_adopting_node_claims_none_of_a_paused_rules_keys(
        shard: Shard) -> None:  # noqa: F811
    await shard.r.set(shard.keys.leader, "1|leader")  # a leader that lacks the rule
    await shard.r.hset(shard.keys.rules, mapping={"leader": f"|{OTHER}=a|",
                                                   "n2": f"|{PAUSED}=a|"})
    await shard.touch("p1", "p2", rule=PAUSED)
    await mark_paused(shard.r, [shard.keys], PAUSED, paused=True)

    async def adopt() -> AdoptBatch:
        return await shard.scripts.adopt(shard.keys, node_id="n2", claim_lease_ms=60_000,
                                         limits=[(PAUSED, 100)], item_rules=NO_ITEM_RULES)

    batch = await adopt()
    assert batch.served == 1 and batch.claims == []
    assert await shard.r.zcard(shard.keys.due(PAUSED)) == 2

    await mark_paused(shard.r, [shard.keys], PAUSED, paused=False)
    resumed = await adopt()
    assert sorted(c.key for c in resumed.claims) == ["p1", "p2"]


async def test_on_a_cluster_a_pause_reaches_every_shards_slot_before_it_returns(
        cluster: Cluster, namespace: str, rules_file: RulesFactory) -> None:
    path = rules_file(CLUSTER_RULES.format(ns=namespace), "async def refresh(claim): pass\n")
    async with Coalescer.from_yaml(path, redis_url=cluster.urls[0], worker=False) as c:
        assert await c.query.pause("stats") is True
        space = KeySpace(namespace, 6)
        for sk in space.all_shards():
            assert await c.redis.smembers(sk.paused) == {"stats"}
            assert await c.redis.cluster_keyslot(sk.paused) == await c.redis.cluster_keyslot(
                sk.due("stats"))  # read in the claim script's own slot
        assert await c.query.resume("stats") is True
        for sk in space.all_shards():
            assert await c.redis.smembers(sk.paused) == set()
