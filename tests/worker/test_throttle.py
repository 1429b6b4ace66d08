"""A rule's rate on a real valkey-server: starts are spread, the excess waits, nothing is
dropped, and every shard's poller on every node shares one bucket.

Each refresh records the server clock when it starts; the tests count the starts
that fall in any one second of that clock (counts, never durations).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio

from coalescer import Coalescer
from coalescer.query.explain import format_explain, gather_explain
from coalescer.query.status import format_status
from coalescer.store.keys import KeySpace, rate_bucket
from coalescer.store.scripts import Scripts
from tests.helpers.e2e import Recorder, recorder_rules, server_ms, settled
from tests.helpers.servers import Cluster, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
defaults:
  window: 50ms
  absorb: 10ms
rules:
  - name: paced
    match: "paced:{{id}}"
    handler: {{mod}}:refresh
    rate: {rate}
  - name: free
    match: "free:{{id}}"
    handler: {{mod}}:refresh
"""

Start = Callable[..., Awaitable[Coalescer]]


# A handler records its start a moment after the claim that took the token; a stall of
# the machine can bring two claims' records closer than their tokens were: one more.
SLACK = 1


def most_in_one_second(starts: list[int]) -> int:
    """The most starts (server-clock ms) inside any one second [t, t + 1000)."""
    starts = sorted(starts)
    best, j = 0, 0
    for i, t in enumerate(starts):
        while starts[j] <= t - 1000:
            j += 1
        best = max(best, i - j + 1)
    return best


@pytest_asyncio.fixture
async def start(redis_url: str) -> AsyncIterator[Start]:
    nodes: list[Coalescer] = []

    async def make(path: Path, **options: Any) -> Coalescer:
        c = Coalescer.from_yaml(path, redis_url=redis_url, grace=2.0, **options)
        await c.start()
        nodes.append(c)
        return c

    yield make
    for c in reversed(nodes):
        await c.close()


def paced_rules(tmp_path: Path, namespace: str, redis: Any, *, rate: str,
                shards: int = 1) -> tuple[Path, Recorder]:
    path, rec = recorder_rules(tmp_path, f"rate_{namespace}",
                               RULES.format(ns=namespace, shards=shards, rate=rate))

    async def clock() -> int:
        return await server_ms(redis)
    rec.clock = clock
    return path, rec


async def make_due(start: Start, path: Path, redis: Any, keys: list[str]) -> None:
    """Make ``keys`` pending through a write-only node, and wait until all are due."""
    writer = await start(path, worker=False)
    writer.touch_many(keys)
    await writer.flush()
    space = KeySpace(writer.config.namespace, writer.config.shards)
    last = 0.0
    for sk in space.all_shards():
        for rule in ("paced", "free"):
            top = await redis.zrange(sk.due(rule), -1, -1, withscores=True)
            last = max([last, *(score for _, score in top)])

    async def all_due() -> bool:
        return await server_ms(redis) >= last
    await wait_until(all_due, message="every key due")


async def test_starts_are_spread_at_the_rate_in_due_order_and_none_is_dropped(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start) -> None:
    path, rec = paced_rules(tmp_path, namespace, redis_client, rate="5/s")
    keys = [f"paced:{i}" for i in range(15)]
    free = [f"free:{i}" for i in range(15)]
    await make_due(start, path, redis_client, keys + free)
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.succeeded) == 30, timeout=30,
                     message="every key refreshed")
    paced = [t for claim, t in zip(rec.calls, rec.start_ms, strict=True)
             if claim.rule == "paced"]
    unpaced = [t for claim, t in zip(rec.calls, rec.start_ms, strict=True)
               if claim.rule == "free"]
    assert sorted(x.key for x in rec.succeeded) == sorted(keys + free)
    # 5 a second plus the bucket's one token of burst; the other rule is not held back
    assert most_in_one_second(paced) <= 5 + 1 + SLACK
    assert most_in_one_second(unpaced) == 15
    dues = [x.due_ms for x in rec.calls if x.rule == "paced"]
    assert dues == sorted(dues)  # the earliest due starts first
    await wait_until(lambda: settled(redis_client, namespace), message="all acked")
    assert c.metrics.rate_waits.labels("paced")._value.get() > 0
    assert c.metrics.held_by_rate() == 0


async def test_two_nodes_leading_one_shard_each_share_one_rate(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, rec = paced_rules(tmp_path, namespace, redis_client, rate="10/s", shards=2)
    takers: set[str] = set()
    real = Scripts.take_rate

    async def counted(self: Scripts, *args: Any, **kwargs: Any) -> Any:
        takers.add(str(id(self)))
        return await real(self, *args, **kwargs)
    monkeypatch.setattr(Scripts, "take_rate", counted)
    n1 = await start(path, node_id="n1")
    n2 = await start(path, node_id="n2")
    await wait_until(lambda: len(n1.leads()) == 1 and len(n2.leads()) == 1, timeout=20,
                     message="each node leads one shard")
    keys = [f"paced:{i}" for i in range(40)]
    space = KeySpace(namespace, 2)
    assert {space.shard_of(k) for k in keys} == {0, 1}
    await make_due(start, path, redis_client, keys)
    await wait_until(lambda: len(rec.succeeded) == 40, timeout=30,
                     message="every key refreshed")
    assert sorted(x.key for x in rec.succeeded) == sorted(keys)
    assert most_in_one_second(rec.start_ms) <= 10 + 1 + SLACK  # both nodes together
    assert len(takers) == 2  # both nodes took from the one bucket
    assert await redis_client.exists(rate_bucket(namespace, "paced")) == 1


async def test_explain_and_metrics_say_a_due_key_waits_for_the_rate(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start) -> None:
    path, rec = paced_rules(tmp_path, namespace, redis_client, rate="1/m")
    keys = ["paced:1", "paced:2", "paced:3"]
    await make_due(start, path, redis_client, keys)
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.succeeded) == 1, message="the first key refreshed")
    await wait_until(lambda: c.metrics.held_by_rate() == 2, message="two keys held")
    text = c.metrics.registry.get_sample_value("coalescer_rate_held_keys",
                                               {"rule": "paced"})
    assert text == 2
    waiting = sorted(set(keys) - {rec.calls[0].key})
    last = await gather_explain(redis_client, c.config, waiting[-1])
    assert last["state"] == "pending"
    assert last["rule"]["rate"] == "1/m"
    assert last["rate_wait"] == {"rate": "1/m", "due_now": 2}
    shown = format_explain(last)
    assert ("waits for the rule's rate (1/m refresh starts, cluster-wide), with 2 keys of "
            "the rule due on this shard") in shown
    assert "rate 1/m" in shown
    assert json.loads(json.dumps(last)) == last
    assert len(rec.calls) == 1  # the bucket refills in a minute
    status = await c.query.status()
    assert status["rules"]["paced"] | {"rate": "1/m", "due_now": 2} == status["rules"]["paced"]
    assert status["rules"]["free"]["rate"] is None
    assert "due_now" not in status["rules"]["free"]
    assert "  paced                           1/m  2 keys due now" in format_status(
        status, await server_ms(redis_client))
    free = await gather_explain(redis_client, c.config, "free:1")
    assert free["rule"]["rate"] is None and "rate_wait" not in free


async def test_a_shard_with_nothing_due_takes_nothing_from_the_bucket(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, rec = paced_rules(tmp_path, namespace, redis_client, rate="100/s")
    calls = [0]
    real = Scripts.take_rate

    async def counted(self: Scripts, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(self, *args, **kwargs)
    monkeypatch.setattr(Scripts, "take_rate", counted)
    c = await start(path, node_id="n1")
    await wait_until(lambda: c.leads() == [0], message="n1 leads")
    c.touch("free:1")
    await wait_until(lambda: len(rec.succeeded) == 1, message="the free key refreshed")
    c.touch("paced:1")
    await wait_until(lambda: len(rec.succeeded) == 2, message="the paced key refreshed")
    assert calls[0] == 1  # one take, for the one paced key
    assert await redis_client.exists(rate_bucket(namespace, "paced")) == 1


async def test_on_a_cluster_the_bucket_has_a_slot_of_its_own_and_paces_every_shard(
        tmp_path: Path, namespace: str, cluster: Cluster) -> None:
    clock = redis.asyncio.Redis.from_url(cluster.urls[0], decode_responses=True)
    try:
        path, rec = paced_rules(tmp_path, namespace, clock, rate="10/s", shards=4)
        nodes = [Coalescer.from_yaml(path, redis_url=url, node_id=f"node-{i}", grace=2.0)
                 for i, url in enumerate(cluster.urls[:2])]
        for node in nodes:
            await node.start()
        try:
            await wait_until(lambda: all(node.leads() for node in nodes), timeout=20,
                             message="both nodes lead shards")
            c = nodes[0]
            keys = [f"paced:{i}" for i in range(30)]
            c.touch_many(keys)
            await c.flush()
            await wait_until(lambda: len(rec.succeeded) == 30, timeout=30,
                             message="every key refreshed")
            assert sorted(x.key for x in rec.succeeded) == sorted(keys)
            assert most_in_one_second(rec.start_ms) <= 10 + 1 + SLACK
            bucket = await c.redis.cluster_keyslot(rate_bucket(namespace, "paced"))
            shard_slots = {await c.redis.cluster_keyslot(sk.meta)
                           for sk in KeySpace(namespace, 4).all_shards()}
            assert bucket not in shard_slots
            status = await c.query.status()
            assert status["rules"]["paced"]["rate"] == "10/s"
            assert status["rules"]["paced"]["due_now"] == 0
        finally:
            for node in nodes:
                await node.close()
    finally:
        await clock.aclose()


async def test_a_drain_runs_every_due_key_whatever_the_rate(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start) -> None:
    path, _ = paced_rules(tmp_path, namespace, redis_client, rate="1/m")
    keys = [f"paced:{i}" for i in range(5)]
    c = await start(path, worker=False)
    c.touch_many(keys)
    await c.flush()
    claims = await c.drain(timeout=10)
    assert sorted(x.key for x in claims) == keys


async def test_a_rated_rule_claims_only_what_it_can_start_at_once(
        tmp_path: Path, namespace: str, redis_client: Any, start: Start) -> None:
    path, rec = paced_rules(tmp_path, namespace, redis_client, rate="5/s")
    path.write_text(path.read_text().replace("    rate: 5/s\n", "    rate: 5/s\n"
                                             "    concurrency: 3\n"))
    gate = asyncio.Event()

    async def held(_claim: Any) -> None:
        await gate.wait()
    rec.hook = held
    keys = [f"paced:{i}" for i in range(12)]
    await make_due(start, path, redis_client, keys)
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.calls) == 3, message="three refreshes running")
    later = await server_ms(redis_client) + 1500  # the bucket refills 7 times meanwhile

    async def passed() -> bool:
        return await server_ms(redis_client) >= later
    await wait_until(passed, message="1.5 s of the server clock")
    # no claim waits in process for a slot: it would start later, bunched past the rate
    assert c._run.node is not None and c._run.node.runner.holding == 3
    sk = KeySpace(namespace, 1).shard(0)
    assert await redis_client.zcard(sk.inflight("paced")) == 3
    gate.set()
    await wait_until(lambda: len(rec.succeeded) == 12, timeout=30, message="all refreshed")
    assert most_in_one_second(rec.start_ms) <= 5 + 1 + SLACK
