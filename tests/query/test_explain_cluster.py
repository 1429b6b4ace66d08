"""`coalescer explain` (GET /keys/{key}) on a Redis Cluster: the key's state, items and
due time, read on the master of its shard's slot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from coalescer import Coalescer
from tests.helpers.servers import Cluster

RULES = """\
namespace: {ns}
shards: 4
rules:
  - name: orders
    match: "orders:{{id}}"
    window: 30s
    items: {{max: 3}}
    handler: builtins:print
"""


async def test_explain_reads_a_key_on_a_redis_cluster(
        cluster: Cluster, rules_file: Callable[..., Path], namespace: str) -> None:
    async with Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)),
                                   redis_url=cluster.url, worker=False) as c:
        for n in range(8):  # keys of every shard, on every master
            c.touch(f"orders:{n}", f"line-{n}")
        await c.flush()
        for n in range(8):
            info = await c.query.explain(f"orders:{n}")
            assert info["state"] == "pending", info
            assert info["items"]["pending_items"] == [f"line-{n}"]
            assert info["due_ms"] - info["first_touch_ms"] == 30_000
            assert 0 < info["due_ms"] - info["now_ms"] <= 30_000
        assert (await c.query.explain("orders:99"))["state"] == "idle"
