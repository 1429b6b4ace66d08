"""A source whose events carry a time (``delay:``) stays inside ``limits.pending_keys``:
past it, its entries are rejected (counted, acknowledged, logged), never touched; on a
real valkey-server, writing entries with XADD."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.servers import wait_until
from tests.sources.test_streams import entries_counted, group_info, nodes, setup

__all__ = ["nodes"]  # the fixture, used by name

RULES = """\
namespace: {ns}
claim_lease: 1s
limits: {{pending_keys: 5}}
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
rules:
  - name: order
    match: "order:unpaid:{{id}}"
    handler: {{mod}}:refresh
sources:
  - name: orders
    stream: "{ns}-app:orders"
    group: "g-{ns}"
    key: "order:unpaid:{{orderId}}"
    delay: "{{delayTime}}m"
"""


def counted(c: Coalescer) -> int | None:
    quota = c._run.quota
    return None if quota is None else quota.pending


async def test_a_delay_source_cannot_push_pending_keys_past_the_limit(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.streams")
    path, _ = setup(tmp_path, namespace, RULES.format(ns=namespace))
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream, f"g-{namespace}"))
    for n in range(5):
        await redis_client.xadd(stream, {"orderId": f"a{n}", "delayTime": "30"})
    await wait_until(lambda: entries_counted(c, "accepted") == 5)
    await wait_until(lambda: counted(c) == 5, message="a count of the 5 pending keys")
    for n in range(20):
        await redis_client.xadd(stream, {"orderId": f"b{n}", "delayTime": "30"})
    await wait_until(lambda: entries_counted(c, "rejected") == 20,
                     message="the 20 entries past the limit rejected")
    assert entries_counted(c, "accepted") == 5
    due = KeySpace(namespace, 1).shard(0).due("order")
    assert await redis_client.zcard(due) == 5
    group = await group_info(redis_client, stream, f"g-{namespace}")
    assert group is not None and group["pending"] == 0  # every entry acknowledged
    assert (await c.query.status())["sources"]["orders"]["rejected"] == 20
    assert "limits.pending_keys (5)" in "\n".join(r.getMessage() for r in caplog.records)


async def test_an_entry_scheduled_past_max_schedule_ahead_is_rejected_naming_the_limit(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.streams")
    text = RULES.format(ns=namespace).replace("{pending_keys: 5}",
                                              "{max_schedule_ahead: 1h}")
    path, _ = setup(tmp_path, namespace, text)
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream, f"g-{namespace}"))
    far = await redis_client.xadd(stream, {"orderId": "far", "delayTime": "61"})
    await redis_client.xadd(stream, {"orderId": "near", "delayTime": "59"})
    await wait_until(lambda: entries_counted(c, "accepted") == 1)
    await wait_until(lambda: entries_counted(c, "rejected") == 1)
    due = KeySpace(namespace, 1).shard(0).due("order")
    assert await redis_client.zrange(due, 0, -1) == ["order:unpaid:near"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"entry {far} of stream" in logged
    assert "61m is more than limits.max_schedule_ahead (1h) ahead" in logged
