"""The poller and handler slots, in process on a real valkey-server.

Keys due at once are claimed as fast as handler slots free: a slot freed while
work is due leads to a claim at once, at every ``concurrency`` (1, the default
16, and with several shards sharing a node's slots). These tests count claim
calls and refreshes, never times: a poller that missed a freed slot would need
about two claim calls per batch and a capped sleep for each, and one that spun
on full slots would make claim calls while nothing can be claimed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from coalescer import Claim, Coalescer
from coalescer.store.keys import KeySpace
from coalescer.store.scripts import Scripts
from tests.helpers.e2e import Recorder, recorder_rules, server_ms, settled
from tests.helpers.servers import wait_until

# No concurrency line unless a test sets one: the default (16) applies. The default
# leader lease (3 s) makes an idle poller sleep its longest, 1.2 s, between claims.
RULES = """\
namespace: {ns}
shards: {shards}
defaults:
  window: 100ms
  absorb: 10ms
{concurrency}rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


Rules = Callable[..., tuple[Path, Recorder]]


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Rules:
    """rules(shards=1, concurrency=None, claim_lease=None) -> the rules file and its
    handler's Recorder."""
    def make(*, shards: int = 1, concurrency: int | None = None,
             claim_lease: str | None = None) -> tuple[Path, Recorder]:
        line = "" if concurrency is None else f"  concurrency: {concurrency}\n"
        text = RULES.format(ns=namespace, shards=shards, concurrency=line)
        if claim_lease is not None:
            text = f"claim_lease: {claim_lease}\n{text}"
        return recorder_rules(tmp_path, f"rec_{namespace}", text)
    return make


class ClaimCounter:
    """Counts the claim script calls of every node in this process."""

    def __init__(self) -> None:
        self.calls = 0


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> ClaimCounter:
    counter = ClaimCounter()
    real = Scripts.claim

    async def counted(self: Scripts, *args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(Scripts, "claim", counted)
    return counter


Start = Callable[..., Awaitable[Coalescer]]


def hold_each(rec: Recorder) -> dict[str, asyncio.Event]:
    """Make each refresh wait until the test sets its key's event (created on first use)."""
    gates: dict[str, asyncio.Event] = {}

    async def held(claim: Claim) -> None:
        await gates.setdefault(claim.key, asyncio.Event()).wait()
    rec.hook = held
    return gates


def holding(c: Coalescer) -> int:
    """Claims the node holds: running, waiting in process, or finished but not acked."""
    assert c._run.node is not None
    return c._run.node.runner.holding


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


async def make_due(start: Start, path: Path, redis: Any, keys: list[str],
                   shards: int = 1) -> None:
    """Make ``keys`` pending through a write-only node, and wait until all are due."""
    writer = await start(path, worker=False)
    writer.touch_many(keys)
    await writer.flush()
    await writer.close()
    space = KeySpace(writer.config.namespace, shards)
    last = 0.0
    for sk in space.all_shards():
        top = await redis.zrange(sk.due("item"), -1, -1, withscores=True)
        last = max([last, *(score for _, score in top)])

    async def all_due() -> bool:
        return await server_ms(redis) >= last
    await wait_until(all_due, message="every key due")


@pytest.mark.parametrize("concurrency", [1, None, 5])
async def test_due_keys_take_one_claim_per_batch_of_free_slots(
        rules: Rules, redis_client: Any, start: Start, claims: ClaimCounter,
        concurrency: int | None) -> None:
    path, rec = rules(concurrency=concurrency)
    n = 20 if concurrency == 1 else 12 * (concurrency or 16)
    keys = [f"item:{i}" for i in range(n)]
    await make_due(start, path, redis_client, keys)
    before = claims.calls
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.succeeded) == n, timeout=30,
                     message=f"all {n} due keys refreshed")
    used = claims.calls - before
    await wait_until(lambda: settled(redis_client, c.config.namespace),
                     message="every refresh acked")
    assert sorted(c.key for c in rec.succeeded) == sorted(keys)
    # one claim fills the free slots; the next one follows the freed slots at once
    # (a missed wake-up costs a second claim call per batch, and a capped sleep)
    batches = math.ceil(n / (concurrency or 16))
    assert used <= batches + 3, f"{used} claim calls for {batches} batches"


async def test_a_rule_with_every_slot_busy_does_not_spin(
        rules: Rules, redis_client: Any, start: Start, claims: ClaimCounter) -> None:
    path, rec = rules(concurrency=1)
    gates = hold_each(rec)
    keys = [f"item:{i}" for i in range(5)]
    await make_due(start, path, redis_client, keys)
    c = await start(path, node_id="n1")
    for i in range(1, len(keys) + 1):
        await wait_until(lambda i=i: len(rec.calls) == i, message=f"refresh {i} running")
        before = claims.calls
        for _ in range(100):  # 100 round trips while the only slot is busy
            await redis_client.ping()
        await c.flush()
        # none, or one at the end of a capped sleep; a spinning poller makes dozens
        assert claims.calls - before <= 1
        gates.setdefault(rec.calls[-1].key, asyncio.Event()).set()
    await wait_until(lambda: settled(redis_client, c.config.namespace),
                     message="every refresh acked")
    assert sorted(x.key for x in rec.succeeded) == sorted(keys)


@pytest.mark.parametrize("concurrency", [1, None])
async def test_shards_share_the_slots_of_a_rule(
        rules: Rules, redis_client: Any, start: Start, concurrency: int | None) -> None:
    shards = 4
    path, rec = rules(shards=shards, concurrency=concurrency)
    running = [0, 0]  # now, most at once

    async def work(_claim: Claim) -> None:
        running[0] += 1
        running[1] = max(running)
        try:
            await asyncio.sleep(0.002)  # the handler's work: lets refreshes overlap
        finally:
            running[0] -= 1
    rec.hook = work
    n = 40 if concurrency == 1 else 200
    keys = [f"item:{i}" for i in range(n)]
    await make_due(start, path, redis_client, keys, shards)
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.succeeded) == n, timeout=30,
                     message=f"all {n} due keys refreshed")
    assert c.leads() == list(range(shards))
    assert sorted(x.key for x in rec.succeeded) == sorted(keys)
    assert running[1] == (concurrency or 16)


async def test_a_claim_waiting_in_process_starts_when_the_slot_frees_without_a_claim_call(
        rules: Rules, redis_client: Any, start: Start, claims: ClaimCounter) -> None:
    path, rec = rules(concurrency=1)
    gates = hold_each(rec)
    keys = ["item:1", "item:2", "item:3"]
    await make_due(start, path, redis_client, keys)
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.calls) == 1, message="the first refresh running")
    # one refresh runs and one more is claimed, waiting in process; the third stays in Redis
    space = KeySpace(c.config.namespace, 1).shard(0)
    await wait_until(lambda: holding(c) == 2, message="two claims held")
    assert await redis_client.zcard(space.inflight("item")) == 2
    assert await redis_client.zcard(space.due("item")) == 1
    before = claims.calls
    gates.setdefault(rec.calls[0].key, asyncio.Event()).set()
    await wait_until(lambda: len(rec.calls) == 2, message="the waiting claim started")
    assert claims.calls - before <= 1  # it started from the node, not from a claim call
    assert rec.calls[1].key != rec.calls[0].key
    for key in keys:
        gates.setdefault(key, asyncio.Event()).set()
    await wait_until(lambda: len(rec.succeeded) == 3, message="all refreshed")
    assert max(rec.max_active.values()) == 1


async def test_a_waiting_claim_whose_lease_was_lost_never_starts(
        rules: Rules, redis_client: Any, start: Start) -> None:
    path, rec = rules(concurrency=1)
    gate = asyncio.Event()

    async def held(_claim: Claim) -> None:
        await gate.wait()
    rec.hook = held
    await make_due(start, path, redis_client, ["item:1", "item:2"])
    c = await start(path, node_id="n1")
    await wait_until(lambda: len(rec.calls) == 1 and holding(c) == 2,
                     message="one refresh running, one claim waiting")
    running = rec.calls[0].key
    waiting = ({"item:1", "item:2"} - {running}).pop()
    meta = KeySpace(c.config.namespace, 1).shard(0).meta
    # Another holder took the waiting key over (a newer token): this node's claim is stale.
    await redis_client.hset(meta, waiting, "R|999999|1|1|1|1||||other-node")
    assert c._run.node is not None
    await c._run.node.runner.renew_once()  # the next lease renewal, now
    await wait_until(lambda: holding(c) == 1, message="the stale claim dropped")
    gate.set()
    await wait_until(lambda: len(rec.succeeded) == 1 and holding(c) == 0,
                     message="the running refresh acked")
    assert [x.key for x in rec.calls] == [running]


async def test_a_close_past_its_grace_leaves_running_and_waiting_claims_to_their_leases(
        rules: Rules, redis_url: str, redis_client: Any, start: Start,
        caplog: pytest.LogCaptureFixture) -> None:
    path, rec = rules(concurrency=1, claim_lease="1s")
    gates = hold_each(rec)
    await make_due(start, path, redis_client, ["item:1", "item:2"])
    c = Coalescer.from_yaml(path, redis_url=redis_url, node_id="n1", grace=0.2)
    await c.start()
    await wait_until(lambda: len(rec.calls) == 1 and holding(c) == 2,
                     message="one refresh running, one claim waiting")
    await c.close()  # the running one is cancelled after 0.2 s; the waiting one never starts
    assert [x.key for x in rec.calls] == [rec.calls[0].key]
    assert "cancelling 1 refresh still running after 0.2s" in caplog.text
    for key in ("item:1", "item:2"):
        gates.setdefault(key, asyncio.Event()).set()
    # Both claims are re-queued once their 1 s lease expires, and another node runs them.
    await start(path, node_id="n2")
    await wait_until(lambda: sorted(x.key for x in rec.succeeded) == ["item:1", "item:2"],
                     timeout=30, message="both keys refreshed by n2")
