"""The status page at GET / in a real headless Chromium, and the endpoints it reads.

A real worker node on a real server, with pending keys, refreshes and a dead letter:
the page (after its script ran) shows the node and what it leads, each rule's
counts, the next due keys, the start-lag chart, the failures and the dead key, and
its retry button re-queues the key in Redis, with and without a bearer token.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from tests.helpers.browser import MISSING_REASON, Browser, find_chromium
from tests.helpers.servers import ValkeyProcess, wait_until

TOKEN = "page-t0ken"
HOSTILE = 'flaky:<img src=x onerror="document.body.dataset.pwned=1">'

RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: agg
    match: "agg:{{id}}"
    handler: {module}:agg
  - name: later
    match: "later:{{id}}"
    window: 1h
    max_wait: 2h
    handler: {module}:agg
  - name: flaky
    match: "flaky:{{id}}"
    window: 100ms
    concurrency: 1
    retry: {{attempts: 1}}
    handler: {module}:flaky
  - name: bulk
    match: "bulk:{{id}}"
    window: 100ms
    batch: {{max: 10, wait: 1s}}
    handler: {module}:bulk
"""

HANDLERS = """\
failing = True
succeeded = []

async def agg(claim):
    pass

async def flaky(claim):
    if failing:
        raise RuntimeError("upstream is down for " + claim.key)
    succeeded.append(claim.key)

async def bulk(claims):
    pass
"""


class PageNode:
    """A worker coalescer, its HTTP API and its handlers module."""

    def __init__(self, c: Coalescer, api: HttpApi, module: str) -> None:
        self.c, self.api, self.module = c, api, module

    @property
    def handlers(self) -> Any:
        return sys.modules[self.module]

    async def get(self, path: str, token: str | None = None,
                  **kwargs: Any) -> tuple[int, Any]:
        headers = dict(kwargs.pop("headers", {}))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        async with aiohttp.ClientSession() as http, http.request(
                kwargs.pop("method", "GET"), self.api.url + path, headers=headers,
                **kwargs) as answer:
            text = await answer.text()
            if answer.content_type == "application/json":
                return answer.status, json.loads(text)
            return answer.status, text

    async def dead(self, key: str) -> bool:
        page = await self.c.query.dead_letters([key])
        return bool(page.entries)


NodeFactory = Callable[..., Awaitable[PageNode]]


@pytest.fixture(scope="session")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.skip(MISSING_REASON[0] if MISSING_REASON else "chromium is not available")
    return found


@pytest_asyncio.fixture
async def make_node(redis_url: str, namespace: str,
                    tmp_path: Path) -> AsyncIterator[NodeFactory]:
    module = f"page_{namespace}"
    (tmp_path / f"{module}.py").write_text(HANDLERS)
    sys.path.insert(0, str(tmp_path))
    opened: list[tuple[Coalescer, HttpApi]] = []

    async def make(*, shards: int = 4, url: str = redis_url, token: str | None = None,
                   worker: bool = True) -> PageNode:
        rules = tmp_path / "rules.yaml"
        rules.write_text(RULES.format(ns=namespace, shards=shards, module=module))
        c = Coalescer.from_yaml(rules, redis_url=url, worker=worker, node_id="page-node-1")
        await c.start()
        api = HttpApi(c, port=0, token=token)
        opened.append((c, api))
        await api.start()
        return PageNode(c, api, module)

    yield make
    for c, api in reversed(opened):
        await api.close()
        await c.close()
    sys.path.remove(str(tmp_path))
    sys.modules.pop(module, None)


async def populated(make_node: NodeFactory, **options: Any) -> PageNode:
    """A node leading every shard, with 3 pending keys, 2 refreshes and a dead key."""
    node = await make_node(**options)
    await wait_until(lambda: node.c.leads() == list(range(node.c.config.shards)),
                     timeout=20, message="the node to lead every shard")
    node.c.touch_many(["later:1", "later:2", "later:3", "agg:1", "agg:2", HOSTILE,
                       "bulk:1", "bulk:2", "bulk:3", "bulk:4"])
    await node.c.flush()
    await wait_until(lambda: node.dead(HOSTILE), timeout=20, message="the dead letter")

    async def two_refreshes() -> bool:
        found = await node.c.query.history()
        return (len([r for r in found if r.rule == "agg"]) == 2
                and len([r for r in found if r.rule == "bulk"]) == 4)

    await wait_until(two_refreshes, timeout=20, message="both agg refreshes")
    return node


async def show_page(browser: Browser, node: PageNode) -> None:
    await browser.goto(node.api.url + "/")
    await browser.wait_for("document.querySelector('#dead tr[data-key] button.retry')",
                           message="the dead letter on the page")


def cell(table: str, row: str, column: int) -> str:
    """JS: the text of one cell of a row picked by a CSS selector."""
    return (f"document.querySelector({json.dumps(f'#{table} {row}')})"
            f".children[{column}].textContent")


async def test_the_page_shows_the_cluster_and_its_retry_button_requeues_a_dead_key(
        chromium: str, make_node: NodeFactory, redis_client: redis.asyncio.Redis,
        namespace: str, tmp_path: Path) -> None:
    node = await populated(make_node, shards=4)
    node.c.touch("bulk:9", delay="2h")  # waits for a time of its own
    await node.c.flush()
    async with Browser(chromium) as browser:
        await show_page(browser, node)
        assert (await browser.evaluate(
            "document.querySelector(\"tr[data-rule='bulk'] .scheduled\").textContent")
            ) == "1 scheduled, the next in 2.0 h"
        assert await browser.evaluate("document.querySelectorAll('.scheduled').length") == 1
        assert await browser.evaluate(cell("nodes", "tr[data-node='page-node-1']", 1)) == "4"
        assert await browser.evaluate(cell("rules", "tr[data-rule='later']", 1)) == "3"
        assert await browser.evaluate(cell("rules", "tr[data-rule='flaky']", 3)) == "1"
        assert await browser.evaluate(cell("rules", "tr[data-rule='agg']", 4)) == "2"
        assert await browser.evaluate(
            "document.querySelector(\"tr[data-rule='bulk'] .batches\").textContent") == (
            "batches of 4 keys on average")
        assert await browser.evaluate("document.querySelectorAll('.batches').length") == 1
        due = await browser.evaluate(
            "[...document.querySelectorAll('#due table[data-due-rule=later] tr')]"
            ".map(tr => tr.dataset.key)")
        assert sorted(due) == ["later:1", "later:2", "later:3"]
        dead_text = await browser.evaluate("document.querySelector('#dead tbody').textContent")
        assert HOSTILE in dead_text and "upstream is down for" in dead_text
        assert await browser.evaluate("document.querySelectorAll('#dead img').length") == 0
        assert await browser.evaluate("document.body.dataset.pwned") is None
        failures = await browser.evaluate("document.querySelector('#failures tbody').textContent")
        assert HOSTILE in failures
        assert await browser.evaluate("document.querySelectorAll('#lag-svg circle').length") >= 2
        shot = await browser.screenshot(tmp_path / "status-page.png")
        assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 10_000

        node.handlers.failing = False
        await browser.evaluate("document.querySelector('#dead button.retry').click()")
        await wait_until(lambda: node.handlers.succeeded == [HOSTILE], timeout=20,
                         message="the re-queued key to be refreshed")
        sk = KeySpace(namespace, 4).shard(KeySpace(namespace, 4).shard_of(HOSTILE))
        assert await redis_client.zscore(sk.dead("flaky"), HOSTILE) is None
        assert "re-queued 1 key" in await browser.wait_for(
            "document.querySelector('#retry-msg[data-done]')?.textContent")
        await browser.wait_for("document.querySelector('#dead tbody').textContent"
                               ".includes('no dead letters')")


async def test_with_a_token_the_page_asks_for_it_and_retry_needs_it(
        chromium: str, make_node: NodeFactory) -> None:
    node = await populated(make_node, shards=1, token=TOKEN)
    status, html = await node.get("/")
    assert status == 200 and "<title>coalescer status</title>" in html
    status, body = await node.get("/dead/retry", method="POST", json={"keys": [HOSTILE]})
    assert status == 401 and "bearer token" in body["error"]
    assert await node.dead(HOSTILE)
    async with Browser(chromium) as browser:
        await browser.goto(node.api.url + "/")
        await browser.wait_for("document.querySelector('#token-form.shown')")
        assert "cannot update" in await browser.evaluate("document.querySelector('#state')"
                                                         ".textContent")
        await browser.evaluate("document.querySelector('#token').value = 'wrong';"
                               "document.querySelector('#token-save').click()")
        await browser.wait_for("document.querySelector('#token-msg').textContent"
                               " === 'the token was refused'")
        await browser.evaluate(f"document.querySelector('#token').value = {TOKEN!r};"
                               "document.querySelector('#token-save').click()")
        await browser.wait_for("document.querySelector('#dead tr[data-key] button.retry')")
        assert await browser.evaluate("sessionStorage.getItem('coalescer-token')") == TOKEN
        node.handlers.failing = False
        await browser.evaluate("document.querySelector('#dead button.retry').click()")
        await wait_until(lambda: node.handlers.succeeded == [HOSTILE], timeout=20,
                         message="the re-queued key to be refreshed")
        assert not await node.dead(HOSTILE)


# --- the endpoints, without a browser ---------------------------------------------------


@pytest.mark.parametrize("shards", [1, 8])
async def test_due_lists_the_earliest_keys_of_each_rule_across_shards(
        make_node: NodeFactory, redis_client: redis.asyncio.Redis, namespace: str,
        shards: int) -> None:
    node = await make_node(shards=shards, worker=False)
    node.c.touch_many([f"later:{i}" for i in range(20)])
    await node.c.flush()
    node.c.touch_many(["agg:x", "later:last"])
    await node.c.flush()
    status, body = await node.get("/due?n=3")
    assert status == 200
    every = sorted([(int(score), key) for sk in KeySpace(namespace, shards).all_shards()
                    for key, score in await redis_client.zrange(sk.due("later"), 0, -1,
                                                                withscores=True)])
    assert [(k["due_ms"], k["key"]) for k in body["rules"]["later"]] == every[:3]
    assert "later:last" not in [k["key"] for k in body["rules"]["later"]]
    assert [k["key"] for k in body["rules"]["agg"]] == ["agg:x"]
    assert body["rules"]["flaky"] == []
    assert body["now_ms"] < every[0][0]  # an hour's window: not due yet
    status, body = await node.get("/due")
    assert len(body["rules"]["later"]) == 5  # the default


async def test_history_records_each_refresh_with_its_due_time(make_node: NodeFactory,
                                                              redis_client: redis.asyncio.Redis
                                                              ) -> None:
    node = await make_node(shards=2)
    before = await server_ms(redis_client)
    node.c.touch_many(["agg:1", "agg:2"])
    await node.c.flush()
    after = await server_ms(redis_client)
    found = await wait_until(lambda: two(node), timeout=20, message="two refreshes")
    for r in found:
        assert r["outcome"] == "success"
        assert before + 2000 <= r["due_ms"] <= after + 2000  # the default window, 2 s
    status, body = await node.get("/history?n=1")
    assert status == 200 and len(body["refreshes"]) == 1
    status, body = await node.get("/history?rule=flaky&failed=1")
    assert status == 200 and body["refreshes"] == []


async def two(node: PageNode) -> list[dict[str, Any]] | None:
    status, body = await node.get("/history?n=10&rule=agg")
    assert status == 200
    return body["refreshes"] if len(body["refreshes"]) == 2 else None


async def server_ms(client: redis.asyncio.Redis) -> int:
    secs, micros = await client.time()
    return int(secs) * 1000 + int(micros) // 1000


@pytest.mark.parametrize(("path", "status", "says"), [
    ("/history?n=0", 400, "n must be a whole number from 1 to 1000, got '0'"),
    ("/history?n=1001", 400, "from 1 to 1000"),
    ("/history?n=abc", 400, "got 'abc'"),
    ("/history?n=%D9%A3", 400, "whole number"),  # an Arabic-Indic digit
    ("/history?failed=maybe", 400, "failed must be 1 or 0, got 'maybe'"),
    ("/history?n=1&n=2", 400, "'n' is given more than once"),
    ("/history?bogus=1", 400, "unknown query parameter 'bogus'"),
    ("/history?rule=nope", 422, "no rule is named 'nope'"),
    ("/due?n=101", 400, "from 1 to 100"),
    ("/due?rule=agg", 400, "unknown query parameter 'rule'"),
])
async def test_bad_queries_are_json_errors(make_node: NodeFactory, path: str, status: int,
                                           says: str) -> None:
    node = await make_node(shards=1, worker=False)
    got, body = await node.get(path)
    assert (got, says in body["error"]) == (status, True), body


@pytest.mark.parametrize(("raw", "says"), [
    (b"", "empty body"),
    (b"{", "malformed JSON"),
    (b"[]", "must be a JSON object"),
    (b'{"keys": "flaky:1"}', "'keys' must be a list"),
    (b'{"keys": [1]}', "keys[0] must be a string"),
    (b'{"keys": [], "all": true}', "unknown field 'all'"),
    (b"\xff", "not UTF-8"),
])
async def test_retry_refuses_a_bad_body_with_400(make_node: NodeFactory, raw: bytes,
                                                 says: str) -> None:
    node = await make_node(shards=1, worker=False)
    status, body = await node.get("/dead/retry", method="POST", data=raw,
                                  headers={"Content-Type": "application/json"})
    assert status == 400 and says in body["error"], body


async def test_retry_of_unknown_or_unstorable_keys_is_422_and_retries_nothing(
        make_node: NodeFactory) -> None:
    node = await populated(make_node, shards=2)
    status, body = await node.get("/dead/retry", method="POST",
                                  json={"keys": [HOSTILE, "nope:1"]})
    assert (status, body["unknown_keys"]) == (422, ["nope:1"])
    assert "1 key matches no rule; nothing was retried" in body["error"]
    status, body = await node.get("/dead/retry", method="POST",
                                  json={"keys": [HOSTILE, "flaky:a\u0000b"]})
    assert status == 422 and body["invalid_keys"][0]["index"] == 1
    assert await node.dead(HOSTILE)


async def test_retry_answers_which_keys_were_not_dead(make_node: NodeFactory) -> None:
    node = await populated(make_node, shards=2)
    node.handlers.failing = False
    status, body = await node.get("/dead/retry", method="POST",
                                  json={"keys": [HOSTILE, "flaky:never-touched"]})
    assert (status, body) == (200, {"retried": 1, "not_dead": ["flaky:never-touched"]})
    await wait_until(lambda: node.handlers.succeeded == [HOSTILE], timeout=20,
                     message="the re-queued key to be refreshed")
    status, body = await node.get("/dead/retry", method="POST", json={"keys": []})
    assert (status, body) == (200, {"retried": 0, "not_dead": []})


async def test_redis_down_is_503_on_the_page_endpoints(own_server: ValkeyProcess,
                                                       make_node: NodeFactory) -> None:
    node = await make_node(shards=2, url=own_server.url, worker=False)
    own_server.stop()
    for method, path, body in [("GET", "/due", None), ("GET", "/history", None),
                               ("POST", "/dead/retry", {"keys": ["flaky:1"]})]:
        status, answer = await node.get(path, method=method, json=body)
        assert status == 503 and "cannot" in answer["error"], (path, answer)
    status, html = await node.get("/")
    assert status == 200 and "<script>" in html
