"""A fair rule over several shards, end to end through one node on a real server: each
shard keeps its own fair order, so tenants at equal weight with keys in every shard
share the first claims to within one claim batch per shard; without ``fair`` the same
count finds the first tenant far ahead (the bound can fail)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until

SHARDS = 4
CONCURRENCY = 16
BATCH = 2 * CONCURRENCY  # keys one claim call takes at most: running and queued slots
TENANTS = ("a", "b", "c")
PER_TENANT = 1200  # 300 a shard: none runs out in the first FIRST claims
FIRST = 1200

RULES = """\
namespace: {ns}
shards: {shards}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 5ms
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    handler: {{mod}}:refresh
    concurrency: {concurrency}
    {fair}
"""


async def leads_every_shard(c: Coalescer, namespace: str) -> bool:
    space = KeySpace(namespace, SHARDS)
    return all([await c.redis.get(sk.leader) for sk in space.all_shards()])


async def server_s(c: Coalescer) -> float:
    sec, usec = await c.redis.time()
    return int(sec) + int(usec) / 1e6


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "due-order"])
async def test_equal_tenants_over_four_shards_share_the_first_claims_within_a_batch_a_shard(
        tmp_path: Path, namespace: str, redis_url: str, start: Start, fair: bool) -> None:
    text = RULES.format(ns=namespace, shards=SHARDS, concurrency=CONCURRENCY,
                        fair='fair: {by: "{org}"}' if fair else "")
    path, rec = recorder_rules(tmp_path, f"fairshards_{namespace}_{fair}", text)
    c = await start(path, redis_url=redis_url, worker=True)
    await wait_until(lambda: leads_every_shard(c, namespace), timeout=30,
                     message="the node leads every shard")
    # every key due at one instant, a's first in due order (ties go by key), so a claim
    # in due order would take a's keys before any of b's or c's, in every shard
    due = await server_s(c) + 2.0
    c.touch_many([f"t:{org}:{i}" for org in TENANTS for i in range(PER_TENANT)], at=due)
    await c.flush()
    assert await server_s(c) < due, "every key written before any fell due"
    await wait_until(lambda: len(rec.calls) >= FIRST, timeout=60,
                     message=f"{FIRST} refreshes started")

    counts = Counter(claim.params["org"] for claim in rec.calls[:FIRST])
    bound = SHARDS * BATCH
    off = {org: abs(counts[org] - FIRST // len(TENANTS)) for org in TENANTS}
    if fair:
        assert max(off.values()) <= bound, counts
    else:
        assert counts["a"] - FIRST // len(TENANTS) > bound, counts


WEIGHTS = {"a": 5, "b": 3, "c": 2}
WEIGHED_FIRST = 3000  # claims counted: a's share is 1,500
WEIGHED_PER_TENANT = 2400  # 600 a shard: none runs out in the first WEIGHED_FIRST claims


async def test_weights_hold_over_four_shards_as_the_node_takes_its_shards_in_turn(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    # A shard drained to its end hands out every tenant's keys in it, whatever the
    # weights: the node must claim from its shards at even rates for 5:3:2 to hold.
    weights = ", ".join(f"{org}: {w}" for org, w in WEIGHTS.items())
    text = RULES.format(ns=namespace, shards=SHARDS, concurrency=CONCURRENCY,
                        fair=f'fair: {{by: "{{org}}", weights: {{{weights}}}}}')
    path, rec = recorder_rules(tmp_path, f"fairweights_{namespace}", text)
    c = await start(path, redis_url=redis_url, worker=True)
    await wait_until(lambda: leads_every_shard(c, namespace), timeout=30,
                     message="the node leads every shard")
    due = await server_s(c) + 2.0
    c.touch_many([f"t:{org}:{i}" for org in TENANTS for i in range(WEIGHED_PER_TENANT)],
                 at=due)
    await c.flush()
    assert await server_s(c) < due, "every key written before any fell due"
    await wait_until(lambda: len(rec.calls) >= WEIGHED_FIRST, timeout=60,
                     message=f"{WEIGHED_FIRST} refreshes started")

    counts = Counter(claim.params["org"] for claim in rec.calls[:WEIGHED_FIRST])
    total = sum(WEIGHTS.values())
    off = {org: abs(counts[org] - WEIGHED_FIRST * w // total) for org, w in WEIGHTS.items()}
    assert max(off.values()) <= SHARDS * BATCH, counts
