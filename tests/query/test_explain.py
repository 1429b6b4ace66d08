"""`coalescer explain KEY` and GET /keys/{key}: a key's rule, state and why, last refreshes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import redis.asyncio

from coalescer import Coalescer, UnknownKeyError
from coalescer.cli.main import main
from coalescer.query.explain import format_explain
from coalescer.store.keys import ShardKeys
from coalescer.web.api import HttpApi
from tests.helpers.e2e import server_ms
from tests.helpers.inspection import DEFAULTS, fast_rules, node, write
from tests.helpers.servers import wait_until

LONG = "60s"  # a window no test waits for


def long_rules(ns: str, *, window: str = LONG, max_wait: str = "2m", attempts: int = 5,
               backoff: str = "1m") -> str:
    return f"""\
namespace: {ns}
shards: 3
claim_lease: 5s
rules:
  - name: user-stats
    match: "stats:user:{{id}}"
    window: {window}
    max_wait: {max_wait}
    retry: {{attempts: {attempts}, backoff: {backoff}, max_backoff: 5m}}
    handler: {{mod}}:refresh
"""


async def state_of(c: Coalescer, key: str, state: str) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        info = await c.query.explain(key)
        return info if info["state"] == state else None
    result: dict[str, Any] = await wait_until(reached, message=f"{key} {state}")
    return result


async def test_default_rules_idle_then_pending_by_window(tmp_path: Path, redis_url: str,
                                                         namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, DEFAULTS.format(ns=namespace))
    async with node(rules, redis_url, worker=False) as c:
        idle = await c.query.explain("item:7")
        assert idle["state"] == "idle" and idle["last_refreshes"] == []
        assert idle["rule"] == {
            "name": "item", "match": "item:{id}", "handler": idle["rule"]["handler"],
            "window": 2.0, "max_wait": 30.0, "absorb": 0.05, "timeout": 30.0,
            "concurrency": 16, "retry": {"attempts": 5, "backoff": 1.0, "max_backoff": 300.0},
            "rate": None,
            "batch": None, "items": None, "edge": "trailing"}
        assert idle["items"] is None
        assert "idle" in format_explain(idle)
        c.touch("item:7")
        await c.flush()
        info = await c.query.explain("item:7")
    assert info["state"] == "pending" and info["due_reason"] == "window"
    assert info["due_ms"] == info["last_touch_ms"] + 2000
    assert info["first_touch_ms"] == info["last_touch_ms"] and info["attempts"] == 0
    text = format_explain(info)
    assert "pending: due in" in text and "by window: last touch + 2s" in text


async def test_pending_by_max_wait(tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, long_rules(namespace, window=LONG, max_wait=LONG))
    async with node(rules, redis_url, worker=False) as c:
        c.touch("stats:user:1")
        await c.flush()
        first = (await c.query.explain("stats:user:1"))["first_touch_ms"]
        await wait_until(lambda: _later(c, first), message="the server clock to move on")
        c.touch("stats:user:1")
        await c.flush()
        info = await c.query.explain("stats:user:1")
    assert info["last_touch_ms"] > info["first_touch_ms"] == first
    assert info["due_reason"] == "max_wait" and info["due_ms"] == first + 60_000
    assert "by max wait: first touch + 1m" in format_explain(info)


async def _later(c: Coalescer, ms: int) -> bool:
    return await server_ms(c.redis) > ms


async def test_running_shows_node_token_lease_and_touch_while_running(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, module = write(tmp_path, namespace, fast_rules(namespace, shards=2,
                                                          timeout="30s"))
    async with node(rules, redis_url, node_id="worker|7") as c:
        c.touch("hold:a b|ü")
        info = await state_of(c, "hold:a b|ü", "running")
        run = info["running"]
        assert run["node"] == "worker|7" and run["attempt"] == 1 and run["token"] > 0
        assert 0 < run["lease_left_ms"] <= 5000 and run["touched_again"] is None
        c.touch("hold:a b|ü")
        await c.flush()
        again = (await c.query.explain("hold:a b|ü"))["running"]["touched_again"]
        assert again["due_ms"] == again["last_touch_ms"] + 50
        text = format_explain(await c.query.explain("hold:a b|ü"))
        assert "running on node worker|7, token" in text and "s left" in text
        module.gate.set()
        done = await state_of(c, "hold:a b|ü", "idle")
    assert [r["outcome"] for r in done["last_refreshes"]] == ["success", "success"]
    assert done["last_refreshes"][0]["node"] == "worker|7"


async def test_backoff_shows_the_last_error_then_dead(tmp_path: Path, redis_url: str,
                                                      namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, attempts=2, backoff="60s"))
    async with node(rules, redis_url) as c:
        c.touch("bad:1")
        info = await state_of(c, "bad:1", "backoff")
        assert info["attempts"] == 1 and info["due_reason"] == "retry"
        assert info["last_error"] == "RuntimeError: no such user: bad:1"
        assert 29_000 < info["due_ms"] - info["now_ms"] <= 60_000  # 50-100% jitter of 1m
        text = format_explain(info)
        assert "retry backoff after attempt 1 of 2 failed" in text
        assert "last error: RuntimeError: no such user: bad:1" in text
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, attempts=1))
    async with node(rules, redis_url) as c:
        c.touch("bad:2")
        dead = await state_of(c, "bad:2", "dead")
    assert dead["dead"]["error"] == "RuntimeError: no such user: bad:2"
    assert dead["attempts"] == 1 and dead["dead"]["since_ms"] <= dead["now_ms"]
    assert [(r["outcome"], r["attempt"]) for r in dead["last_refreshes"]] == [("failure", 1)]
    assert "dead since" in format_explain(dead)


async def test_a_running_state_of_the_older_format_still_explains(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    shard = ShardKeys(namespace, 0)
    await redis_client.hset(shard.meta, "ok:1", "R|5|100|200|1|300")
    async with node(rules, redis_url, worker=False) as c:
        info = await c.query.explain("ok:1")
    assert info["running"]["node"] is None and info["running"]["token"] == 5
    assert "running on node (unknown), token 5" in format_explain(info)


async def test_unknown_key_is_refused(tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    async with node(rules, redis_url, worker=False) as c:
        with pytest.raises(UnknownKeyError):
            await c.query.explain("nomatch:1")


def test_cli_explain(tmp_path: Path, redis_url: str, namespace: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, long_rules(namespace))

    async def touch() -> None:
        async with node(rules, redis_url, worker=False) as c:
            c.touch("stats:user:9")
    asyncio.run(touch())
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["explain", *base, "stats:user:9"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stats:user:9  (shard ") and "pending: due in" in out
    assert main(["explain", *base, "stats:user:9", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["state"] == "pending" and info["rule"]["window"] == 60.0
    assert main(["explain", *base, "nomatch:1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"coalescer explain: no rule in {rules} matches key 'nomatch:1'"]


async def test_http_keys_route(tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, long_rules(namespace))
    key = "stats:user:a/b ü%"
    async with node(rules, redis_url, worker=False) as c, HttpApi(c, port=0) as api, \
            aiohttp.ClientSession() as http:
        c.touch(key)
        await c.flush()
        async with http.get(f"{api.url}/keys/{quote(key)}") as response:
            assert response.status == 200
            body = await response.json()
        direct = await c.query.explain(key)
        async with http.get(f"{api.url}/keys/{quote('nomatch:1')}") as response:
            assert response.status == 404
            error = await response.json()
    assert body["key"] == key and body["state"] == "pending"
    assert {k: v for k, v in body.items() if k != "now_ms"} == {
        k: v for k, v in direct.items() if k != "now_ms"}
    assert error == {"error": "no rule matches key 'nomatch:1'", "key": "nomatch:1"}
