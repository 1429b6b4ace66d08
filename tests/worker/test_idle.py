"""An idle node's cost follows the node, not its shards: one lease renewal a period.

Counts come from the server's ``INFO commandstats`` (commands run inside scripts
included); a window is a number of the node's lease renewals, never a duration.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from coalescer import Coalescer
from coalescer.store.keys import KeySpace, node_leases
from tests.helpers.e2e import NodeProcs, leader_node, line_rules, recorder_rules
from tests.helpers.leases import PROBE, calls, renewals
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: {mod}:refresh
"""

async def over_four_renewals(client: Any, probe: Any, namespace: str,
                             node: str) -> dict[str, int]:
    """The commands the server ran, by name, over four lease renewals of ``node`` (after
    two to settle), the probe's own reads left out."""
    await renewals(probe, namespace, node, 2)
    before = calls(client)
    await renewals(probe, namespace, node, 4)
    after = calls(client)
    return {name: n - before.get(name, 0) for name, n in after.items()
            if name not in (PROBE, "info")}


async def idle_commands(server: ValkeyProcess, tmp_path: Path, namespace: str,
                        shards: int) -> int:
    """Commands the server ran while an idle node leading ``shards`` renewed its lease
    four times (after two renewals to settle)."""
    folder = tmp_path / f"s{shards}"
    folder.mkdir()
    path, _ = recorder_rules(folder, f"idle_{namespace}_{shards}",
                             RULES.format(ns=namespace, shards=shards, mod="{mod}"))
    client = server.client()
    try:
        async with Coalescer.from_yaml(path, redis_url=server.url, node_id="idle") as node:
            await wait_until(lambda: len(node.leads()) == shards, timeout=60,
                             message="the node leads every shard")
            delta = await over_four_renewals(client, node.redis, namespace, "idle")
    finally:
        client.close()
    return sum(delta.values())


async def test_an_idle_node_costs_the_same_commands_per_lease_period_at_1_and_512_shards(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    one = await idle_commands(own_server, tmp_path, namespace + "a", 1)
    many = await idle_commands(own_server, tmp_path, namespace + "b", 512)
    # four renewals of about eight commands each (the script call, those it runs), and
    # a spare one for the renewal the window may cut: nothing per shard
    assert one <= 5 * 8
    assert many <= 5 * 8, f"{many} commands at 512 shards, {one} at 1"


async def fleet_commands(server: ValkeyProcess, tmp_path: Path, namespace: str,
                         nodes: int) -> tuple[int, int]:
    """Commands the server ran, and script calls among them, while ``nodes`` idle nodes
    sharing the shards renewed their leases: the window is four renewals of the first."""
    path, _ = recorder_rules(tmp_path, f"fleet_{namespace}",
                             RULES.format(ns=namespace, shards=nodes, mod="{mod}"))
    client = server.client()
    try:
        async with AsyncExitStack() as stack:
            started = [await stack.enter_async_context(
                Coalescer.from_yaml(path, redis_url=server.url, node_id=f"n{i}"))
                for i in range(nodes)]
            await wait_until(lambda: all(len(n.leads()) == 1 for n in started), timeout=60,
                             message="every node leads one shard")
            delta = await over_four_renewals(client, started[0].redis, namespace, "n0")
    finally:
        client.close()
    return sum(delta.values()), delta.get("evalsha", 0) + delta.get("eval", 0)


async def test_idle_nodes_renew_with_one_script_call_a_period_and_look_with_one_command(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    nodes = 3
    total, scripts = await fleet_commands(own_server, tmp_path, namespace, nodes)
    # each node, each period: one renewal (the script call and the four commands it runs)
    # and one look just after the others' leases would end (one plain ZRANGE): six, so
    # sixteen nodes with a 3 s lease (a period of 2.25 s) make under 50 commands/s.
    # Four periods, and a spare one for the period the window may cut.
    assert scripts <= 5 * nodes, f"{scripts} script calls"
    assert total <= 5 * nodes * 6, f"{total} commands for {nodes} nodes over 4 periods"
    assert total / 4 / nodes * 16 / 2.25 <= 50


async def renew_forever(r: Any, leases: str, node: str) -> None:
    """A live node's lease, as another node sees it: its end moves on every renewal."""
    while True:
        seconds, micros = await r.time()
        await r.zadd(leases, {node: int(seconds) * 1000 + int(micros) // 1000 + 3000})
        await asyncio.sleep(0.2)


async def test_a_lapsed_node_lease_stops_the_shard_another_node_took_and_keeps_the_other(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path, rec = recorder_rules(tmp_path, f"lapse_{namespace}",
                               RULES.format(ns=namespace, shards=2, mod="{mod}"))
    space = KeySpace(namespace, 2)
    keys = {space.shard_of(f"stats:{i}"): f"stats:{i}" for i in range(20)}
    async with Coalescer.from_yaml(path, redis_url=own_server.url, node_id="me") as node:
        await wait_until(lambda: node.leads() == [0, 1], message="me leads both shards")
        r = node.redis
        leases = node_leases(namespace)
        # another node (alive: it keeps renewing its lease) took shard 1, and dropped
        # our lease as lapsed
        other = asyncio.ensure_future(renew_forever(r, leases, "other"))
        try:
            await r.set(space.shard(1).leader, "999|other")
            await r.zrem(leases, "me")
            await wait_until(lambda: node.leads() == [0], timeout=10,
                             message="shard 1 stopped; shard 0 led again")
            async with Coalescer.from_yaml(path, redis_url=own_server.url,
                                           worker=False) as w:
                w.touch_many([keys[1], keys[0]])
                await w.flush()
            await wait_until(lambda: keys[0] in {c.key for c in rec.calls}, timeout=20,
                             message="shard 0's key refreshed")
            assert keys[1] not in {c.key for c in rec.calls}  # shard 1 is the other's
            assert node.leads() == [0]
            assert await r.zscore(space.shard(1).due("stats"), keys[1]) is not None
        finally:
            other.cancel()
    assert any("judged it lapsed" in m.getMessage() for m in caplog.records)


async def test_a_sigkilled_leader_of_many_shards_hands_every_one_to_the_survivor_with_new_epochs(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    shards = 256
    path = line_rules(tmp_path, f"lines_{namespace}",
                      RULES.format(ns=namespace, shards=shards, mod="{mod}"))
    space = KeySpace(namespace, shards)
    r = Redis.from_url(own_server.url, decode_responses=True)
    procs = NodeProcs(tmp_path)

    async def leaders() -> list[str | None]:
        pipe = r.pipeline(transaction=False)
        for sk in space.all_shards():
            pipe.get(sk.leader)
        return list(await pipe.execute())

    try:
        a = procs.start(path, own_server.url, "A", E2E_LOG=str(tmp_path / "log"))
        await wait_until(lambda: _all(leaders, "A"), timeout=60, message="A leads all")
        procs.start(path, own_server.url, "B", E2E_LOG=str(tmp_path / "log"))

        async def shared() -> bool:
            nodes = [leader_node(v) for v in await leaders()]
            return nodes.count("A") == nodes.count("B") == shards // 2
        await wait_until(shared, timeout=60, message="A and B lead half each")
        before = await leaders()
        a.send_signal(signal.SIGKILL)
        a.wait()
        await wait_until(lambda: _all(leaders, "B"), timeout=30,
                         message=f"B leads every shard; its log:\n{procs.log('B')}")
        after = await leaders()
        for old, new in zip(before, after, strict=True):
            assert old is not None and new is not None
            if leader_node(old) == "A":  # taken over: under a larger epoch
                assert int(new.split("|")[0]) > int(old.split("|")[0])
            else:
                assert new == old

        async def forgotten() -> bool:  # B drops A from every shard's node set
            pipe = r.pipeline(transaction=False)
            for sk in space.all_shards():
                pipe.zscore(sk.nodes, "A")
            return all(v is None for v in await pipe.execute())
        await wait_until(forgotten, message="A forgotten in every shard")
    finally:
        procs.stop_all()
        await r.aclose()


async def _all(leaders: Any, node: str) -> bool:
    return all(leader_node(v) == node for v in await leaders())


async def test_a_node_that_joins_is_counted_by_the_others_before_their_next_renewal(
        redis_url: str, namespace: str, tmp_path: Path) -> None:
    """A joining node announces itself: a running node reads the leases at once, not at
    its next renewal (a period later), and hands back the shards above its new share."""
    text = RULES.format(ns=namespace, shards=8, mod="{mod}").replace("leader_lease: 1s",
                                                                     "leader_lease: 30s")
    path, _ = recorder_rules(tmp_path, f"join_{namespace}", text)
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        await wait_until(lambda: len(a.leads()) == 8, message="a leads every shard")
        node = a._run.node
        assert node is not None
        renewal_due = node.node_lease._next  # a's next renewal: 22.5 s away
        async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="b") as b:
            await wait_until(lambda: node.node_lease.live_nodes == 2,
                             message="a counts b")
            assert asyncio.get_running_loop().time() < renewal_due  # heard, not renewed
            await wait_until(lambda: len(a.leads()) == 4 and len(b.leads()) == 4,
                             timeout=30, message="four shards each")
