"""Script calls of many shards on a real local 3-master Redis Cluster: pipelined per
master, and still correct when the client's slot map is stale, a slot is migrating, a
connection dies, the scripts are flushed, or one call of a pipeline fails."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import ClusterError, ResponseError

from coalescer.store.batching import ScriptBatcher
from coalescer.store.connection import Connection, connect
from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts
from tests.helpers.servers import Cluster

RULE = "r"
LONG = 60_000  # ms: a window no test waits for
ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('ERR bad call') end
return {redis.call('EXISTS', KEYS[1]), ARGV[1]}
"""
_fresh = itertools.count()


@pytest.fixture
async def conn(cluster: Cluster) -> AsyncIterator[Connection]:
    connection = await connect(cluster.url)
    assert connection.cluster
    try:
        yield connection
    finally:
        await connection.close()


def _master(cluster: Cluster, name: str) -> Any:
    (server,) = [s for s in cluster.nodes if name.endswith(f":{s.port}")]
    return server


def _counts(cluster: Cluster) -> dict[int, tuple[int, int]]:
    """Per master port: EVALSHA calls so far, and reads of client input so far."""
    out = {}
    for server in cluster.nodes:
        with server.client() as c:
            evalsha = c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
            out[server.port] = (int(evalsha), int(c.info("stats")["total_reads_processed"]))
    return out


def _shards_by_master(client: Any, namespace: str, n: int) -> dict[str, list[ShardKeys]]:
    out: dict[str, list[ShardKeys]] = {}
    for shard in range(n):
        sk = ShardKeys(namespace, shard)
        out.setdefault(client.get_node_from_key(sk.meta).name, []).append(sk)
    return out


async def _held(client: Any, shards: list[ShardKeys]) -> list[int]:
    return [await client.zcard(sk.due(RULE)) for sk in shards]  # one at a time: pool bound


async def _upsert_each(scripts: Scripts, shards: list[ShardKeys], rounds: int) -> list[int]:
    """Each shard's upsert of a key never scheduled before, ``rounds`` times, all at once."""
    return await asyncio.gather(*(
        scripts.upsert(sk, [UpsertGroup(RULE, LONG, LONG, [f"k{next(_fresh)}"])])
        for _ in range(rounds) for sk in shards))


async def test_calls_of_many_shards_reach_each_master_in_fewer_round_trips_than_calls(
        cluster: Cluster, conn: Connection, namespace: str) -> None:
    client = conn.client
    shards = [ShardKeys(namespace, n) for n in range(48)]
    by_master = Counter(client.get_node_from_key(sk.meta).name for sk in shards)
    assert len(by_master) == 3, "48 shards spread over the 3 masters"
    scripts = Scripts(client)
    await _upsert_each(scripts, shards, 1)  # each master loads the script (NOSCRIPT once)

    before = _counts(cluster)
    rounds = 5
    assert await _upsert_each(scripts, shards, rounds) == [1] * (rounds * len(shards))
    after = _counts(cluster)

    for name, n_shards in by_master.items():
        port = _master(cluster, name).port
        calls = n_shards * rounds
        evalsha = after[port][0] - before[port][0]
        reads = after[port][1] - before[port][1]
        assert evalsha == calls, f"{name}: each call sent once, to the master of its slot"
        assert reads <= calls // 4, f"{name}: {calls} calls came in {reads} reads"
    held = await _held(client, shards)
    assert held == [1 + rounds] * len(shards)


async def test_a_call_whose_slot_moved_still_succeeds_and_the_slot_map_is_refreshed(
        conn: Connection, namespace: str) -> None:
    client = conn.client
    shards = [ShardKeys(namespace, n) for n in range(12)]
    scripts = Scripts(client)
    await _upsert_each(scripts, shards, 1)
    moved = shards[0]
    slot = client.keyslot(moved.meta)
    owner = client.get_node_from_key(moved.meta)
    (other, *_) = [n for n in client.get_primaries() if n.name != owner.name]
    client.nodes_manager.slots_cache[slot] = [other]  # stale: the slot "moved" from other

    assert await _upsert_each(scripts, shards, 1) == [1] * len(shards)

    assert client.get_node_from_key(moved.meta).name == owner.name, "MOVED refreshed the map"
    held = await _held(client, shards)
    assert held == [2] * len(shards)


async def test_a_call_into_a_migrating_slot_follows_the_ask_redirection(
        cluster: Cluster, conn: Connection, namespace: str) -> None:
    client = conn.client
    batcher = ScriptBatcher(client)
    echo = client.register_script(ECHO)
    shards = [ShardKeys(namespace, n) for n in range(12)]
    migrating = shards[0]
    slot = client.keyslot(migrating.meta)
    source = _master(cluster, client.get_node_from_key(migrating.meta).name)
    (target, *_) = [s for s in cluster.nodes if s is not source]
    with source.client() as src, target.client() as dst:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.cluster("MYID"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.cluster("MYID"))
        try:
            asked = dst.info("commandstats").get("cmdstat_asking", {}).get("calls", 0)
            results = await asyncio.gather(*(batcher.call(echo, [sk.meta], [str(sk.shard)])
                                             for sk in shards), return_exceptions=True)
            asked_after = dst.info("commandstats").get("cmdstat_asking", {}).get("calls", 0)
        finally:
            for c in (src, dst):
                c.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    # redis-py's own path, which the redirected call takes, sometimes runs out of
    # redirections while the slot migrates (ClusterError, about one run in four on a new
    # cluster): the caller hears it, as the node's loops do, and the call works again
    # once the migration ends; every other call is answered at once
    for i, (sk, result) in enumerate(zip(shards, results, strict=True)):
        if isinstance(result, ClusterError):
            assert sk is migrating, f"shard {sk.shard} is not the migrating one: {result!r}"
            results[i] = await batcher.call(echo, [sk.meta], [str(sk.shard)])
    assert results == [[0, str(sk.shard)] for sk in shards]
    assert asked_after > asked, "the call missing on the source was asked of the target"


async def test_a_script_error_fails_only_its_call_in_the_pipeline(conn: Connection,
                                                                  namespace: str) -> None:
    client = conn.client
    batcher = ScriptBatcher(client)
    echo = client.register_script(ECHO)
    shards = _shards_by_master(client, namespace, 24)
    name, same_master = max(shards.items(), key=lambda item: len(item[1]))
    await batcher.call(echo, [same_master[0].meta], ["warm"])  # loads the script there
    before = batcher.round_trips[name]

    args = ["bad" if i == 2 else f"v{i}" for i in range(len(same_master))]
    results = await asyncio.gather(*(batcher.call(echo, [sk.meta], [arg])
                                     for sk, arg in zip(same_master, args, strict=True)),
                                   return_exceptions=True)

    assert batcher.round_trips[name] - before == 1, "the calls travelled in one pipeline"
    assert isinstance(results[2], ResponseError) and "bad call" in str(results[2])
    assert [r for i, r in enumerate(results) if i != 2] == [
        [0, arg] for i, arg in enumerate(args) if i != 2]


async def test_calls_survive_killed_connections_and_flushed_scripts(
        cluster: Cluster, conn: Connection, namespace: str) -> None:
    client = conn.client
    shards = [ShardKeys(namespace, n) for n in range(24)]
    scripts = Scripts(client)
    await _upsert_each(scripts, shards, 1)  # every master's connections are open now
    for server in cluster.nodes:
        with server.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "normal")  # not this one (SKIPME)
            c.script_flush()

    assert await _upsert_each(scripts, shards, 3) == [1] * (3 * len(shards))
    held = await _held(client, shards)
    assert held == [4] * len(shards)
