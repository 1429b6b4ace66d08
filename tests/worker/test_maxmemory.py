"""A server at ``maxmemory`` under ``noeviction`` refuses touches, but work already in
Redis still runs: claiming and acknowledging never need free memory (they free about
what they write). Touches made meanwhile stay buffered and are written once the server
takes writes again."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from coalescer import Coalescer
from coalescer.store.keys import ShardKeys
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 100ms
    handler: {mod}:refresh
"""
def _acked(node: Coalescer, shard: ShardKeys) -> Callable[[], Awaitable[bool]]:
    async def nothing_in_flight() -> bool:
        return int(await node.redis.zcard(shard.inflight("stats"))) == 0
    return nothing_in_flight


DUE = [f"stats:{i}" for i in range(200)]
FAR = [f"stats:far-{i}" for i in range(2_000)]


async def test_a_node_at_maxmemory_runs_what_is_due_and_keeps_new_touches(
        own_server: ValkeyProcess, tmp_path: Path, namespace: str) -> None:
    rules = RULES.format(ns=namespace, mod="{mod}")
    path, rec = recorder_rules(tmp_path, f"oom_{namespace}", rules)
    admin = own_server.client()
    try:
        async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as w:
            for key in FAR:  # waiting beside them, a year ahead
                w.touch(key, at=time.time() + 365 * 86_400)
            w.touch_many(DUE)
            await w.flush()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write that needs memory is refused
        async with Coalescer.from_yaml(path, redis_url=own_server.url, node_id="n1",
                                       grace=2.0) as node:
            shard = node.keyspace.shard(0)
            await wait_until(lambda: len(rec.succeeded) >= len(DUE), timeout=30,
                             message="every due key refreshed at maxmemory")
            assert sorted(c.key for c in rec.calls) == sorted(DUE)  # each once
            await wait_until(_acked(node, shard), timeout=10,
                             message="every refresh acknowledged at maxmemory")
            node.touch("stats:new")
            await wait_until(lambda: node.unwritten_age() is not None,
                             message="the new touch refused by the server, kept buffered")
            assert "stats:new" not in {c.key for c in rec.calls}
            admin.config_set("maxmemory", 0)
            await node.flush()
            await wait_until(lambda: "stats:new" in {c.key for c in rec.calls}, timeout=10,
                             message="the kept touch refreshed once memory is free")
            assert node.dropped_keys() == []
            waiting = await node.redis.zcard(shard.due("stats"))
            assert waiting == len(FAR)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
