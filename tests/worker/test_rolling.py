"""Rolling deploys: nodes of one namespace with different rules files never strand keys.

Two in-process nodes on a real valkey-server, each loading its own rules file
(default settings, a short leader lease). Node B starts first and leads; node A
knows a rule B lacks (and, in some tests, B knows one A lacks). Each node's
handler records what it refreshed, so the tests see who served which key.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from coalescer import Claim, Coalescer
from coalescer.config.rules import Config
from coalescer.store.keys import KeySpace, node_leases
from coalescer.worker.registry import encode
from tests.helpers.e2e import Recorder, server_ms
from tests.helpers.servers import wait_until

RulesFactory = Callable[..., Path]

HEAD = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
rules:
"""
ITEM = """\
  - name: item
    match: "item:{id}"
    handler: handlers:refresh
"""
ONLY_A = """\
  - name: only-a
    match: "a:{id}"
    handler: handlers:refresh
"""
ONLY_B = """\
  - name: only-b
    match: "b:{id}"
    handler: handlers:refresh
"""
HANDLERS = """\
from tests.helpers.e2e import Recorder

rec = Recorder()


async def refresh(claim):
    await rec.refresh(claim)
"""


class Node:
    """A loaded rules file and the recorder its handler writes to."""

    def __init__(self, rules_file: RulesFactory, text: str) -> None:
        self.path = rules_file(text, HANDLERS)
        self.config = Config.from_yaml(self.path)  # imports this node's own handlers module
        self.rec: Recorder = sys.modules["handlers"].rec


class Overlap:
    """A hook for every node's handler: counts refreshes of one key running at once."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.most = 0

    async def __call__(self, claim: Claim) -> None:
        self.running[claim.key] += 1
        self.most = max(self.most, self.running[claim.key])
        await asyncio.sleep(0.02)
        self.running[claim.key] -= 1


Start = Callable[..., Awaitable[Coalescer]]


@pytest_asyncio.fixture
async def start(redis_url: str) -> AsyncIterator[Start]:
    """start(node, node_id, worker=True) -> a started Coalescer, closed at teardown."""
    async with AsyncExitStack() as stack:
        async def make(node: Node, node_id: str, worker: bool = True) -> Coalescer:
            c = Coalescer(node.config, redis_url=redis_url, node_id=node_id, worker=worker,
                          grace=2.0)
            await stack.enter_async_context(c)
            return c

        yield make


def text(ns: str, shards: int, *rules: str) -> str:
    return HEAD.format(ns=ns, shards=shards) + "".join(rules)


def keys_per_shard(prefix: str, shards: int, per_shard: int = 2) -> list[str]:
    """Keys ``prefix:N`` covering every shard ``per_shard`` times."""
    space, found, n = KeySpace("any", shards), Counter[int](), 0
    out = []
    while min((found[s] for s in range(shards)), default=0) < per_shard or len(found) < shards:
        key = f"{prefix}:{n}"
        shard = space.shard_of(key)
        if found[shard] < per_shard:
            found[shard] += 1
            out.append(key)
        n += 1
    return out


async def all_refreshed(recs: list[Recorder], keys: list[str]) -> bool:
    done = {c.key for rec in recs for c in rec.succeeded}
    return set(keys) <= done


def warned(caplog: pytest.LogCaptureFixture, *words: str) -> bool:
    return any(r.levelno == logging.WARNING and all(w in r.getMessage() for w in words)
               for r in caplog.records)


@pytest.mark.parametrize("shards", [1, 4])
async def test_a_rule_the_leader_lacks_is_refreshed_by_the_node_that_knows_it(
        rules_file: RulesFactory, namespace: str, start: Start, shards: int,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    node_b = Node(rules_file, text(namespace, shards, ITEM, ONLY_B))
    node_a = Node(rules_file, text(namespace, shards, ITEM, ONLY_A))
    overlap = Overlap()
    node_a.rec.hook = node_b.rec.hook = overlap
    b = await start(node_b, "B")
    await wait_until(lambda: len(b.leads()) == shards, message="B leads every shard")
    await start(node_a, "A")
    writer_a = await start(node_a, "writer-a", worker=False)  # a write path with A's rules

    a_keys, b_keys = keys_per_shard("a", shards), keys_per_shard("b", shards)
    item_keys = keys_per_shard("item", shards)
    writer_a.touch_many(a_keys + item_keys)
    b.touch_many(b_keys)
    await writer_a.flush()
    await b.flush()
    await wait_until(lambda: all_refreshed([node_a.rec, node_b.rec], a_keys + b_keys + item_keys),
                     timeout=20, message="every key refreshed")

    assert sorted(c.key for c in node_a.rec.succeeded if c.rule == "only-a") == sorted(a_keys)
    assert sorted(c.key for c in node_b.rec.succeeded if c.rule == "only-b") == sorted(b_keys)
    refreshed = Counter(c.key for rec in (node_a.rec, node_b.rec) for c in rec.calls)
    assert set(refreshed.values()) == {1}  # one refresh per key, nobody ran one twice
    assert overlap.most == 1  # never two refreshes of one key at once
    if shards == 1:
        assert b.leads() == [0]  # leadership did not move for it

    await wait_until(lambda: warned(caplog, "lacks rule 'only-a'", "B"),
                     message="B warns that it lacks only-a")
    await wait_until(lambda: warned(caplog, "lacks rule 'only-b'", "A"),
                     message="A warns that it lacks only-b")
    assert b.metrics.registry.get_sample_value("coalescer_rules_missing",
                                               {"rule": "only-a"}) == 1
    status = await b.query.status()
    assert {n["node"]: sorted(n["rules"]) for n in status["nodes"]} == {
        "A": ["item", "only-a"], "B": ["item", "only-b"]}
    assert status["rules_mismatch"]["missing"] == {"only-a": ["B"], "only-b": ["A"]}
    assert status["rules"]["only-a"]["known_by"] == ["A"]
    assert status["rules"]["only-a"]["in_rules_file"] is False


async def test_with_the_only_node_knowing_a_rule_gone_its_keys_wait_until_it_returns(
        rules_file: RulesFactory, namespace: str, start: Start, redis_client: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    node_b = Node(rules_file, text(namespace, 1, ITEM))
    node_a = Node(rules_file, text(namespace, 1, ITEM, ONLY_A))
    b = await start(node_b, "B")
    await wait_until(lambda: b.leads() == [0], message="B leads")
    a = await start(node_a, "A")
    writer_a = await start(node_a, "writer-a", worker=False)
    writer_a.touch("a:1")
    await writer_a.flush()
    await wait_until(lambda: all_refreshed([node_a.rec], ["a:1"]), message="A refreshes a:1")
    await wait_until(lambda: warned(caplog, "lacks rule 'only-a'"), message="B warns")

    await a.close()  # only B is left: it leads and serves its own rule, not only-a
    writer_a.touch_many(["a:2", "item:2"])
    await writer_a.flush()
    due = await redis_client.zscore(KeySpace(namespace, 1).shard(0).due("only-a"), "a:2")
    await wait_until(lambda: all_refreshed([node_b.rec], ["item:2"]), message="B refreshes")
    await wait_until(lambda: _past(redis_client, due + 1500), message="a:2 well past due")
    assert b.leads() == [0]
    assert [c.key for c in node_a.rec.calls] == ["a:1"]
    status = await b.query.status()
    assert status["rules"]["only-a"] | {"pending": 1, "unserved": True, "known_by": []} \
        == status["rules"]["only-a"]
    assert status["rules_mismatch"]["missing"] == {}
    assert [n["node"] for n in status["nodes"]] == ["B"]

    await start(node_a, "A2")  # a node that knows the rule comes back
    await wait_until(lambda: all_refreshed([node_a.rec], ["a:2"]), message="A2 refreshes a:2")
    assert b.leads() == [0]
    assert not (await b.query.status())["rules"]["only-a"]["unserved"]


async def test_a_node_counted_live_before_its_rules_reach_the_registry_is_compared_soon(
        rules_file: RulesFactory, namespace: str, start: Start,
        caplog: pytest.LogCaptureFixture) -> None:
    """A node's lease comes a moment before its first shard call registers its rules: the
    others read the registry again soon, not at the next change or a minute later."""
    caplog.set_level(logging.WARNING)
    b = await start(Node(rules_file, text(namespace, 1, ITEM)), "B")
    await wait_until(lambda: b.leads() == [0], message="B leads")
    scripts = b._run.scripts
    assert scripts is not None
    reads = Counter[str]()
    peers = scripts.peers

    async def counted(*args: Any, **kwargs: Any) -> Any:
        found = await peers(*args, **kwargs)
        reads["registry"] += 1
        return found

    scripts.peers = counted  # type: ignore[method-assign]
    await scripts.node_lease(node_leases(namespace), node_id="ghost", lease_ms=60_000)
    await wait_until(lambda: reads["registry"] > 0, message="B reads the registry")
    assert not warned(caplog, "lacks rule")  # the ghost's rules are not there yet
    await scripts.acquire(KeySpace(namespace, 1).shard(0), node_id="ghost", lease_ms=60_000,
                          mine="", rules=encode(Node(rules_file, text(
                              namespace, 1, ITEM, ONLY_A)).config.rules))
    await wait_until(lambda: warned(caplog, "lacks rule 'only-a'", "ghost"),
                     message="B warns")


async def _past(r: Any, ms: float) -> bool:
    return await server_ms(r) > ms


async def test_a_rule_with_other_settings_on_another_node_is_flagged_and_served(
        rules_file: RulesFactory, namespace: str, start: Start,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    node_b = Node(rules_file, text(namespace, 1, ITEM))
    slower = ITEM.replace("handler:", "window: 1s\n    handler:")
    node_a = Node(rules_file, text(namespace, 1, slower))
    b = await start(node_b, "B")
    await wait_until(lambda: b.leads() == [0], message="B leads")
    a = await start(node_a, "A")
    a.touch("item:1")
    await a.flush()
    await wait_until(lambda: all_refreshed([node_b.rec], ["item:1"]), message="B refreshes")
    await wait_until(lambda: warned(caplog, "rule 'item' differs", "A")
                     and warned(caplog, "rule 'item' differs", "B"), message="both warn")
    status = await a.query.status()
    assert sorted(status["rules_mismatch"]["differing"]["item"]) == ["A", "B"]
    assert status["rules_mismatch"]["missing"] == {}
    assert node_a.rec.calls == []
    assert a.metrics.registry.get_sample_value("coalescer_rules_differing",
                                               {"rule": "item"}) == 1


def test_status_table_lists_each_nodes_rules_and_flags_mismatches() -> None:
    from coalescer.query.status import format_status
    status = {
        "namespace": "app", "shards": [{"shard": 0, "leader": "B", "epoch": 1}],
        "rules": {"item": {"pending": 0, "in_flight": 0, "dead": 0, "next_due_ms": None},
                  "only-a": {"pending": 3, "in_flight": 0, "dead": 0, "next_due_ms": 5_000,
                             "unserved": True, "known_by": []}},
        "dead_letters": [],
        "nodes": [{"node": "B", "last_seen_ms": 9_000, "rules": {"item": "abc"}},
                  {"node": "C", "last_seen_ms": 9_000, "rules": {"item": "def"}}],
        "rules_mismatch": {"missing": {"only-b": ["C"]},
                           "differing": {"item": {"B": "abc", "C": "def"}}},
    }
    lines = format_status(status, now_ms=10_000).splitlines()
    assert any(line.split() == ["B", "item"] for line in lines)
    assert "MISMATCH rule only-b: missing on C" in lines
    assert "MISMATCH rule item: settings differ (B abc, C def)" in lines
    assert any(line.startswith("UNSERVED rule only-a: 3 pending") for line in lines)


async def test_adopt_claims_only_for_the_lowest_id_live_node_knowing_a_rule_the_leader_lacks(
        redis_client: Any, namespace: str) -> None:
    from coalescer.store.scripts import Scripts
    scripts, sk = Scripts(redis_client), KeySpace(namespace, 1).shard(0)
    lease = await scripts.acquire(sk, node_id="L", lease_ms=60_000, mine="", rules="|item=f1|")
    assert lease.granted
    await redis_client.zadd(sk.due("r"), {"r:1": 0, "r:2": 0})
    await redis_client.zadd(sk.due("item"), {"item:1": 0})

    async def adopt(node: str) -> list[str]:
        batch = await scripts.adopt(sk, node_id=node,
                                    claim_lease_ms=5_000, limits=[("r", 1), ("item", 16)])
        return [c.key for c in batch.claims]

    # the standbys register; acquire tells the lowest-id knower of r (C) to adopt it
    refused = {n: await scripts.acquire(sk, node_id=n, lease_ms=60_000, mine="", rules=entry)
               for n, entry in (("C", "|item=f1|r=f2|"), ("D", "|item=f1|r=f2|"))}
    assert refused["C"].adopt == ("r",) and refused["D"].adopt == ()
    assert await adopt("D") == []  # C comes first
    assert await adopt("C") == ["r:1"]  # its limit; never item, which the leader knows
    assert await adopt("C") == ["r:2"]
    assert await adopt("C") == []  # nothing is claimed twice
    await redis_client.zrem(sk.nodes, "C")  # C is gone: D serves r
    await redis_client.zadd(sk.due("r"), {"r:3": 0})
    assert await adopt("D") == ["r:3"]
    await redis_client.hdel(sk.rules, "L")  # a leader that registered nothing: nobody adopts
    await redis_client.zadd(sk.due("r"), {"r:4": 0})
    assert await adopt("D") == []


async def test_a_rule_with_a_rate_that_the_leader_lacks_is_paced_by_its_adopter(
        rules_file: RulesFactory, namespace: str, start: Start, redis_client: Any) -> None:
    paced = ONLY_A.replace("    handler:", "    rate: 5/s\n    handler:")
    node_b = Node(rules_file, text(namespace, 1, ITEM))
    node_a = Node(rules_file, text(namespace, 1, ITEM, paced))

    async def clock() -> int:
        return await server_ms(redis_client)
    node_a.rec.clock = clock
    b = await start(node_b, "B")
    await wait_until(lambda: b.leads() == [0], message="B leads")
    await start(node_a, "A")
    writer_a = await start(node_a, "writer-a", worker=False)
    keys = [f"a:{i}" for i in range(15)]
    writer_a.touch_many(keys)
    await writer_a.flush()
    await wait_until(lambda: all_refreshed([node_a.rec], keys), timeout=20,
                     message="A refreshes every key of the rule B lacks")
    assert b.leads() == [0]  # A served them as B's adopter
    starts = sorted(node_a.rec.start_ms)
    most = max(sum(1 for t in starts if s <= t < s + 1000) for s in starts)
    # 5 a second, the bucket's one token of burst, and one for the handler recording its
    # start a moment after its claim
    assert most <= 7
