"""Scale-out on a real local 3-master Redis Cluster."""

from __future__ import annotations

import sys
from collections import Counter

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.leases import PROBE, calls, renewals
from tests.helpers.servers import Cluster, wait_until

RULES = """
namespace: {ns}
shards: 6
leader_lease: 1s
claim_lease: 2s
defaults: {{window: 50ms, max_wait: 1s, absorb: 10ms}}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: handlers:refresh
"""

HANDLERS = """
refreshed = []

async def refresh(claim):
    refreshed.append((claim.key, claim.token))
"""


async def test_cluster_url_is_detected_and_every_shard_is_one_slot(cluster: Cluster,
                                                                    namespace: str,
                                                                    rules_file) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    async with Coalescer.from_yaml(path, redis_url=cluster.urls[1], worker=False) as c:
        assert type(c.redis).__name__ == "RedisCluster"
        for n in range(20):
            c.touch(f"stats:{n}")
        await c.flush()
        space = KeySpace(namespace, 6)
        pending = 0
        for sk in space.all_shards():
            pending += await c.redis.zcard(sk.due("stats"))
            slots = {await c.redis.cluster_keyslot(k) for k in (sk.meta, sk.due("stats"),
                                                                sk.leader, sk.inflight("stats"))}
            assert len(slots) == 1, f"shard {sk.shard} spans slots {slots}"
        assert pending == 20
        status = await c.query.status()  # pipelined reads, each sent to the node of its slot
        assert status["rules"]["stats"]["pending"] == 20
        assert [s["shard"] for s in status["shards"]] == list(range(6))


async def test_three_nodes_share_six_shards_evenly_and_refresh_everything(
        cluster: Cluster, namespace: str, rules_file) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    nodes = [Coalescer.from_yaml(path, redis_url=url, node_id=f"node-{i}")
             for i, url in enumerate(cluster.urls)]
    for node in nodes:
        await node.start()
    try:
        def spread() -> Counter[str]:
            return Counter(node.node_id for node in nodes for _ in node.leads())

        await wait_until(lambda: sorted(spread().values()) == [2, 2, 2], timeout=20,
                         message="each of 3 nodes leads 2 of the 6 shards")
        status = await nodes[0].query.status()
        assert {s["leader"] for s in status["shards"]} == {"node-0", "node-1", "node-2"}

        keys = [f"stats:{n}" for n in range(300)]
        for key in keys:
            nodes[0].touch(key)
        await nodes[0].flush()
        refreshed = sys.modules["handlers"].refreshed
        await wait_until(lambda: {k for k, _ in refreshed} == set(keys), timeout=20,
                         message="every key refreshed")
        assert len(refreshed) == len(keys), "each key refreshed exactly once"

        async def timeline_done() -> bool:  # the scripts wrote it in the key's own slot
            info = await nodes[1].query.timeline("stats:7")
            return [r["outcome"] for r in info["runs"]] == ["success"]
        await wait_until(timeline_done, message="stats:7's timeline: a claim and its success")
    finally:
        for node in nodes:
            await node.close()


async def test_shards_of_a_closed_node_move_to_the_others(cluster: Cluster, namespace: str,
                                                          rules_file) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    nodes = [Coalescer.from_yaml(path, redis_url=url, node_id=f"node-{i}")
             for i, url in enumerate(cluster.urls[:2])]
    for node in nodes:
        await node.start()
    try:
        await wait_until(lambda: sum(len(n.leads()) for n in nodes) == 6, timeout=20)
        await nodes[0].close()
        await wait_until(lambda: len(nodes[1].leads()) == 6, timeout=20,
                         message="the remaining node leads every shard")
        nodes[1].touch("stats:after")
        await nodes[1].flush()
        refreshed = sys.modules["handlers"].refreshed
        await wait_until(lambda: ("stats:after" in {k for k, _ in refreshed}), timeout=10)
    finally:
        for node in nodes:
            await node.close()


ITEM_RULES = """
namespace: {ns}
shards: 6
defaults: {{window: 50ms, max_wait: 1s, absorb: 10ms}}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: handlers:refresh
    items: {{max: 3}}
"""


async def test_items_travel_and_are_claimed_within_their_shards_slot(
        cluster: Cluster, namespace: str, rules_file) -> None:
    """The items sets of a key are built inside the scripts from its shard's prefix: on a
    cluster they must land in (and be moved within) that shard's one slot."""
    path = rules_file(ITEM_RULES.format(ns=namespace), HANDLERS)
    async with Coalescer.from_yaml(path, redis_url=cluster.urls[0], worker=False) as c:
        pairs = [(f"stats:{n}", f"o{n}-{i}") for n in range(12) for i in range(2)]
        c.touch_items([*pairs, ("stats:0", "o0-2"), ("stats:0", "o0-3")])
        await c.flush()
        space = KeySpace(namespace, 6)
        sk = space.shard(space.shard_of("stats:0"))
        slots = {await c.redis.cluster_keyslot(k) for k in (sk.meta, sk.items("stats:0"),
                                                            sk.claimed_items("stats:0"))}
        assert len(slots) == 1
        assert await c.redis.scard(sk.items("stats:0")) == 4  # three and the overflow mark
        done = {claim.key: claim for claim in await c.drain()}
    assert {k: x.items for k, x in done.items() if k != "stats:0"} == {
        f"stats:{n}": (f"o{n}-0", f"o{n}-1") for n in range(1, 12)}
    assert done["stats:0"].items_overflowed and len(done["stats:0"].items) == 3


async def test_an_idle_node_on_a_cluster_renews_one_lease_on_one_master_whatever_the_shards(
        cluster: Cluster, namespace: str, rules_file) -> None:
    text = RULES.format(ns=namespace).replace("shards: 6", "shards: 96")
    path = rules_file(text, HANDLERS)
    masters = [node.client() for node in cluster.nodes]
    try:
        async with Coalescer.from_yaml(path, redis_url=cluster.url, node_id="idle") as node:
            await wait_until(lambda: len(node.leads()) == 96, timeout=60,
                             message="the node leads every shard")
            await renewals(node.redis, namespace, "idle", 2)
            before = [calls(m) for m in masters]
            await renewals(node.redis, namespace, "idle", 4)
            after = [calls(m) for m in masters]
    finally:
        for m in masters:
            m.close()
    ran = [sum(n - b.get(name, 0) for name, n in a.items() if name not in (PROBE, "info"))
           for b, a in zip(before, after, strict=True)]
    # the 96 shards span the three masters; the renewals (about eight commands each, and a
    # spare one the window may cut) go to the one master of the leases key
    assert sum(ran) <= 5 * 8, ran
    assert sorted(ran)[:2] == [0, 0], ran
