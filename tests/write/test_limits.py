"""The rules file's limits: touches refused past pending_keys (nothing accepted is lost),
dead letters dropped past their count or age; on a real valkey-server."""

from __future__ import annotations

import functools
import logging
import textwrap

import aiohttp
import pytest

from coalescer import BackpressureError, Coalescer, QuotaExceededError
from coalescer.web.api import HttpApi
from tests.conftest import RulesFactory, Start
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
shards: {shards}
claim_lease: 2s
limits: {{pending_keys: 5, dead_letters: {dead}, dead_letter_ttl: {ttl}}}
defaults: {{window: {window}, max_wait: 1h, absorb: 10ms, timeout: 2s,
           retry: {{attempts: 1, backoff: 10ms, max_backoff: 10ms}}}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

FAILING = """\
async def refresh(claim):
    raise RuntimeError("broken on purpose")
"""


def rules(namespace: str, *, dead: int = 1000, ttl: str = "1h", window: str = "1h",
          shards: int = 2) -> str:
    return textwrap.dedent(RULES.format(ns=namespace, dead=dead, ttl=ttl, window=window,
                                        shards=shards))


def quota_of(c: Coalescer) -> int | None:
    quota = c._run.quota
    return None if quota is None else quota.pending


async def test_past_pending_keys_a_touch_is_refused_and_every_accepted_key_stays(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), FAILING), redis_url=redis_url, worker=False)
    c.touch_many([f"item:{n}" for n in range(5)])
    await c.flush()
    await wait_until(lambda: quota_of(c) == 5, message="a count of the 5 pending keys")
    with pytest.raises(QuotaExceededError) as info:
        c.touch("item:new")
    assert isinstance(info.value, BackpressureError)
    assert info.value.limit == "pending_keys"
    assert "limits.pending_keys (5)" in str(info.value)
    with pytest.raises(QuotaExceededError):
        await c.touch_wait("item:new", timeout=0.1)  # waiting for room does not get past it
    for n in range(5):
        assert (await c.query.explain(f"item:{n}"))["state"] == "pending"
    assert c.metrics.quota_refusals._value.get() == 2


async def test_past_pending_keys_post_touch_is_429_with_retry_after(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), FAILING), redis_url=redis_url, worker=False)
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{api.port}/touch"
            async with http.post(url, json={"keys": [f"item:{n}" for n in range(6)]}) as r:
                assert r.status == 202  # under the limit when it came: all six are taken
            await c.flush()
            await wait_until(lambda: quota_of(c) == 6)
            async with http.post(url, json={"keys": ["item:7"]}) as r:
                body = await r.json()
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
                assert body["limit"] == "pending_keys"
                assert "limits.pending_keys (5)" in body["error"]
    finally:
        await api.close()
    assert (await c.query.explain("item:5"))["state"] == "pending"


async def test_dead_letters_past_their_count_are_dropped_oldest_first_with_a_count(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.write.quota")
    path = rules_file(rules(namespace, dead=2, window="20ms", shards=1), FAILING)
    c = await start(path, redis_url=redis_url)
    for n in range(6):  # dead-lettered one after the other: item:0 is the oldest
        c.touch(f"item:{n}")
        key = f"item:{n}"  # the newest dead letter: never the one dropped
        await wait_until(functools.partial(_state, c, key, ("dead",)),
                         message=f"{key} dead-lettered")

    async def newest_kept() -> bool:
        return await _dead_keys(c) == ["item:4", "item:5"]

    await wait_until(newest_kept, message="the 2 newest dead letters kept")
    assert c.metrics.dead_letters_dropped.labels("count")._value.get() == 4
    for n in range(4):
        assert (await c.query.explain(f"item:{n}"))["state"] == "idle"  # its state went too
    lines = [r.getMessage() for r in caplog.records if "dead letters dropped" in r.getMessage()]
    assert 1 <= len(lines) <= 4 and all("past limits.dead_letters" in line for line in lines)


async def test_dead_letters_past_their_age_are_dropped(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str) -> None:
    path = rules_file(rules(namespace, ttl="200ms", window="20ms"), FAILING)
    c = await start(path, redis_url=redis_url)
    c.touch_many(["item:1", "item:2"])
    await wait_until(lambda: c.metrics.dead_letters_dropped.labels("age")._value.get() == 2,
                     message="both dead letters dropped for their age")
    assert (await c.query.explain("item:1"))["state"] == "idle"


async def _state(c: Coalescer, key: str, states: tuple[str, ...]) -> bool:
    return (await c.query.explain(key))["state"] in states


async def _dead_keys(c: Coalescer) -> list[str]:
    page = await c.query.dead_letters()
    return sorted(entry["key"] for entry in page.entries)
