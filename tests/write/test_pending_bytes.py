"""``limits.pending_bytes``: the bytes Redis holds for the keys waiting for their
refresh (names, items, schedules) count as well as the keys: past the budget a touch is
refused as past ``pending_keys`` (QuotaExceededError, 429 on HTTP), and the budget frees
once the keys are refreshed or cancelled; on a real valkey-server."""

from __future__ import annotations

import textwrap

import aiohttp
import pytest

from coalescer import Coalescer, QuotaExceededError
from coalescer.web.api import HttpApi
from tests.conftest import RulesFactory, Start
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
shards: 2
limits: {{pending_bytes: 200KiB}}
defaults: {{window: {window}, max_wait: 1h, absorb: 10ms, timeout: 5s}}
rules:
  - name: bag
    match: "bag:{{id}}"
    items: {{max: 1000}}
    handler: handlers:refresh
"""

HANDLERS = """\
async def refresh(claim):
    pass
"""


def rules(namespace: str, window: str = "1h") -> str:
    return textwrap.dedent(RULES.format(ns=namespace, window=window))


def counted(c: Coalescer) -> int | None:
    quota = c._run.quota
    return None if quota is None else quota.bytes


def fill(c: Coalescer, keys: list[str]) -> None:
    """About 130 KB of items for each key (500 items of 250 bytes)."""
    for key in keys:
        c.touch_items([(key, f"{n:03d}" + "x" * 247) for n in range(500)])


async def test_items_past_the_byte_budget_are_refused_until_cancelled(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), HANDLERS), redis_url=redis_url,
                    worker=False)
    fill(c, ["bag:1", "bag:2"])
    await c.flush()
    await wait_until(lambda: (counted(c) or 0) >= 200 * 1024,
                     message="the bytes of the 2 keys counted")
    with pytest.raises(QuotaExceededError) as info:
        c.touch("bag:3", "one more")
    assert info.value.limit == "pending_bytes"
    assert "limits.pending_bytes (200KiB)" in str(info.value)
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{api.port}/touch"
            async with http.post(url, json={"keys": ["bag:4"]}) as r:
                body = await r.json()
                assert r.status == 429
                assert body["limit"] == "pending_bytes"
    finally:
        await api.close()
    assert (await c.query.explain("bag:3"))["state"] == "idle"  # nothing was touched

    outcome = await c.cancel_many(["bag:1", "bag:2"])
    assert outcome.done == 2
    await wait_until(lambda: (counted(c) or 0) < 10 * 1024, message="the bytes freed")
    c.touch("bag:3", "one more")  # taken again
    await c.flush()
    assert (await c.query.explain("bag:3"))["state"] == "pending"


async def test_the_byte_budget_frees_once_the_keys_are_refreshed(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace, window="50ms"), HANDLERS),
                    redis_url=redis_url, worker=False)
    worker = await start(rules_file(rules(namespace, window="50ms"), HANDLERS),
                         redis_url=redis_url, worker=True)
    fill(c, ["bag:1", "bag:2"])
    await c.flush()
    assert (await c.query.explain("bag:1"))["state"] != "idle"

    async def refreshed() -> bool:
        found = [(await worker.query.explain(k))["state"] for k in ("bag:1", "bag:2")]
        return found == ["idle", "idle"]

    await wait_until(refreshed, message="both keys refreshed")
    c.touch("bag:5", "x")  # a touch starts the counting again
    await wait_until(lambda: counted(c) is not None and counted(c) < 10 * 1024,
                     message="the bytes freed")
