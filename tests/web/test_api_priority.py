"""POST /touch with "priority": real HTTP against a real node on a real server."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from coalescer import Coalescer
from coalescer.store import key_states as states
from coalescer.web.api import HttpApi
from tests.web.test_api import HANDLER, Node

RULES = """\
namespace: {ns}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
rules:
  - name: job
    match: "job:{{id}}"
    priority: 0s
    handler: {module}:refresh
  - name: bag
    match: "bag:{{id}}"
    priority: 1s
    items: {{max: 3}}
    handler: {module}:refresh
  - name: plain
    match: "plain:{{id}}"
    handler: {module}:refresh
"""


@pytest_asyncio.fixture
async def node(redis_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Node]:
    module = f"hp_{namespace}"
    (tmp_path / f"{module}.py").write_text(HANDLER)
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(RULES.format(ns=namespace, module=module)))
    coalescer = Coalescer.from_yaml(rules, redis_url=redis_url, worker=False, node_id="n1")
    await coalescer.start()
    api = HttpApi(coalescer, port=0)
    http = aiohttp.ClientSession()
    await api.start()
    yield Node(coalescer, api, http, module)
    await http.close()
    await api.close()
    await coalescer.close()
    sys.modules.pop(module, None)


async def priority_ms(node: Node, key: str) -> int | None:
    await node.c.flush()
    value = await node.c.redis.hget(node.c.keyspace.shard(0).meta, key)
    if isinstance(value, bytes):
        value = value.decode()
    found = None if value is None else states.pending(value)
    return None if found is None else found.priority_ms


async def test_touch_with_a_priority_keeps_it_with_the_keys(node: Node) -> None:
    assert await node.touch({"keys": ["job:1", "job:2"], "priority": "30s"}) == (
        202, {"accepted": 2})
    assert await node.touch({"keys": ["job:3"], "priority": 1.5, "delay": 60}) == (
        202, {"accepted": 1})
    assert await node.touch({"items": [["bag:1", "row-7"]], "priority": "2m"}) == (
        202, {"accepted": 1})

    assert [await priority_ms(node, k) for k in ("job:1", "job:2", "job:3", "bag:1")] == [
        30_000, 30_000, 1500, 120_000]


@pytest.mark.parametrize(("keys", "priority", "says"), [
    (["job:1"], "-5s", "negative: a priority is >= 0"),
    (["job:1"], -1, "negative: a priority is >= 0"),
    (["job:1"], "soon", "not a priority"),
    (["job:1"], [5], "not a priority"),
    (["job:1"], "367d", "more than a year and a day"),
    (["job:1", "plain:1"], "1s", "rule 'plain' orders its due keys by due time only"),
])
async def test_a_bad_priority_is_400_naming_the_field_and_applies_nothing(
        node: Node, keys: list[str], priority: Any, says: str) -> None:
    status, body = await node.touch({"keys": keys, "priority": priority})

    assert status == 400
    assert body["field"] == "priority"
    assert says in body["error"] and "nothing was touched" in body["error"]
    await node.c.flush()
    assert await node.c.redis.hlen(node.c.keyspace.shard(0).meta) == 0
