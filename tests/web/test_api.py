"""The HTTP API: real HTTP against a real node on a real server."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
claim_lease: 2s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 2s
  retry: {{attempts: 3, backoff: 50ms, max_backoff: 200ms}}
rules:
  - name: user-stats
    match: "stats:user:{{user_id}}"
    handler: {module}:refresh
  - name: customer-stats
    match: "stats:customer:{{id}}"
    items: {{max: 3}}
    handler: {module}:refresh
"""

HANDLER = """\
seen = []

async def refresh(claim):
    seen.append(claim)
"""

TOKEN = "t0ps3cret-token"


class Node:
    """A coalescer, its HTTP API and a client session on it."""

    def __init__(self, coalescer: Coalescer, api: HttpApi, http: aiohttp.ClientSession,
                 module: str) -> None:
        self.c = coalescer
        self.api = api
        self.http = http
        self.module = module

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api.port}"

    @property
    def seen(self) -> list[Any]:
        seen: list[Any] = sys.modules[self.module].seen
        return seen

    async def request(self, method: str, path: str, *, token: str | None = None,
                      **kwargs: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.http.request(method, self.url + path, headers=headers,
                                     **kwargs) as response:
            text = await response.text()
        body = json.loads(text) if response.content_type == "application/json" else text
        return response.status, body, response

    async def touch(self, body: Any, **kwargs: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):  # raw bytes, or an async iterator of chunks
            headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
            status, data, _ = await self.request("POST", "/touch", data=body, headers=headers,
                                                 **kwargs)
        else:
            status, data, _ = await self.request("POST", "/touch", json=body, **kwargs)
        return status, data

    async def pending(self, rule: str = "user-stats") -> int:
        await self.c.flush()
        status = await self.c.query.status()
        return int(status["rules"][rule]["pending"])


NodeFactory = Callable[..., Awaitable[Node]]


@pytest_asyncio.fixture
async def make_node(redis_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[NodeFactory]:
    module = f"h_{namespace}"
    (tmp_path / f"{module}.py").write_text(HANDLER)
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(RULES.format(ns=namespace, module=module)))
    opened: list[tuple[Coalescer, HttpApi, aiohttp.ClientSession]] = []

    async def make(*, worker: bool = True, url: str = redis_url, **api_options: Any) -> Node:
        options = {k: api_options.pop(k) for k in ("max_buffered",) if k in api_options}
        coalescer = Coalescer.from_yaml(rules, redis_url=url, worker=worker, node_id="n1",
                                        **options)
        await coalescer.start()
        api = HttpApi(coalescer, port=0, **api_options)
        http = aiohttp.ClientSession()
        opened.append((coalescer, api, http))
        await api.start()
        return Node(coalescer, api, http, module)

    yield make
    for coalescer, api, http in reversed(opened):
        await http.close()
        await api.close()
        await coalescer.close()
    sys.modules.pop(module, None)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels`` (0.0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


# --- POST /touch ----------------------------------------------------------------------


async def test_touch_is_accepted_and_refreshed(make_node: NodeFactory) -> None:
    node = await make_node()
    status, body = await node.touch({"keys": ["stats:user:1", "stats:user:2", "stats:user:1"]})
    assert status == 202
    assert body == {"accepted": 3}

    def refreshed() -> set[str]:
        keys = {claim.key for claim in node.seen}
        return keys if keys == {"stats:user:1", "stats:user:2"} else set()

    await wait_until(refreshed, timeout=5, message="both keys refreshed")
    claim = next(c for c in node.seen if c.key == "stats:user:2")
    assert claim.rule == "user-stats"
    assert claim.params == {"user_id": "2"}
    assert claim.attempt == 1


async def test_touch_with_no_keys_accepts_zero(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    assert await node.touch({"keys": []}) == (202, {"accepted": 0})


@pytest.mark.parametrize(("raw", "says"), [
    (b"", "empty body"),
    (b"   ", "empty body"),
    (b"{", "malformed JSON"),
    (b'{"keys": ["stats:user:1",]}', "malformed JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b'["stats:user:1"]', "got a JSON list"),
    (b'"stats:user:1"', "got a JSON str"),
    (b"{}", "'keys' is missing"),
    (b'{"key": ["stats:user:1"]}', "unknown field 'key'"),
    (b'{"keys": ["stats:user:1"], "extra": 1}', "unknown field 'extra'"),
    (b'{"keys": "stats:user:1"}', "'keys' must be a list of strings, got str"),
    (b'{"keys": null}', "'keys' must be a list of strings, got NoneType"),
    (b'{"keys": ["stats:user:1", 7]}', "keys[1] must be a string, got int"),
    (b'{"keys": ["stats:user:1", ["x"]]}', "keys[1] must be a string, got list"),
    (b'{"keys": ["stats:user:1", ""]}', "keys[1] is an empty string"),
])
async def test_touch_refuses_a_bad_body_with_400(make_node: NodeFactory, raw: bytes,
                                                 says: str) -> None:
    node = await make_node(worker=False)
    status, body = await node.touch(raw, headers={"Content-Type": "application/json"})
    assert status == 400
    assert says in body["error"]
    assert await node.pending() == 0  # nothing of the refused request was applied


async def test_touch_refuses_unknown_keys_with_422_and_applies_nothing(
        make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    status, body = await node.touch({"keys": ["stats:user:1", "nope:1", "stats:org:2"]})
    assert status == 422
    assert body["unknown_keys"] == ["nope:1", "stats:org:2"]
    assert "match no rule" in body["error"]
    assert await node.pending() == 0
    assert await node.touch({"keys": ["stats:user:1"]}) == (202, {"accepted": 1})
    assert await node.pending() == 1


async def test_touch_with_items_delivers_them_to_the_refresh(make_node: NodeFactory) -> None:
    node = await make_node()
    body = {"keys": ["stats:user:1"],
            "items": [["stats:customer:1", "o2"], ["stats:customer:1", "o1"],
                      ["stats:customer:2", "o1"]]}
    assert await node.touch(body) == (202, {"accepted": 4})
    assert await node.touch({"items": [["stats:customer:3", "o9"]]}) == (202, {"accepted": 1})

    def refreshed() -> dict[str, Any]:
        got = {claim.key: claim.items for claim in node.seen}
        return got if len(got) == 4 else {}

    got = await wait_until(refreshed, timeout=5, message="four keys refreshed")
    assert got == {"stats:user:1": (), "stats:customer:1": ("o1", "o2"),
                   "stats:customer:2": ("o1",), "stats:customer:3": ("o9",)}


@pytest.mark.parametrize(("body", "says"), [
    ({}, "the field 'keys' is missing (or 'items')"),
    ({"items": [], "item": []}, "unknown field 'item'"),
    ({"items": "stats:customer:1"}, "'items' must be a list of [KEY, ITEM] pairs, got str"),
    ({"items": {"stats:customer:1": "o1"}}, "'items' must be a list of [KEY, ITEM] pairs"),
    ({"items": ["stats:customer:1"]}, "items[0] must be a [KEY, ITEM] pair of strings, got str"),
    ({"items": [["stats:customer:1"]]}, "items[0] must be a [KEY, ITEM] pair of strings, got "
                                        "a list of 1"),
    ({"items": [["stats:customer:1", "a", "b"]]}, "got a list of 3"),
    ({"items": [["stats:customer:1", "a"], [7, "a"]]}, "items[1][0] must be a string, got int"),
    ({"items": [["stats:customer:1", None]]}, "items[0][1] must be a string, got NoneType"),
    ({"items": [["", "a"]]}, "items[0][0] is an empty string"),
    ({"keys": ["stats:user:1"], "items": [["stats:customer:1", 1.5]]},
     "items[0][1] must be a string, got float"),
])
async def test_touch_refuses_a_bad_items_field_with_400_and_applies_nothing(
        make_node: NodeFactory, body: Any, says: str) -> None:
    node = await make_node(worker=False)
    status, answer = await node.touch(body)
    assert status == 400 and says in answer["error"], answer
    assert await node.pending() == 0 and await node.pending("customer-stats") == 0


@pytest.mark.parametrize(("pair", "says"), [
    (["stats:customer:1", ""], "an item must not be empty"),
    (["stats:customer:1", "a\0b"], "NUL character"),
    (["stats:customer:1", "x" * 257], "over the limit of 256"),
    (["stats:user:1", "o1"], "its rule 'user-stats' takes no items"),
    (["stats:customer:" + "9" * 1100, "o1"], "key cannot be stored"),
])
async def test_touch_refuses_an_item_that_cannot_be_touched_with_422_and_applies_nothing(
        make_node: NodeFactory, pair: list[str], says: str) -> None:
    node = await make_node(worker=False)
    body = {"keys": ["stats:user:2"], "items": [["stats:customer:2", "fine"], pair]}
    status, answer = await node.touch(body)
    assert status == 422, answer
    assert says in answer["error"] and "nothing was touched" in answer["error"]
    [bad] = answer["invalid_items"]
    assert (bad["index"], bad["key"], bad["item"]) == (1, pair[0], pair[1])
    assert says in bad["error"]
    assert await node.pending() == 0 and await node.pending("customer-stats") == 0


async def test_touch_refuses_an_item_of_an_unknown_key_with_422(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    status, answer = await node.touch({"items": [["stats:customer:1", "a"], ["nope:1", "a"]]})
    assert status == 422 and answer["unknown_keys"] == ["nope:1"]
    assert await node.pending("customer-stats") == 0


def _body_of_size(size: int) -> bytes:
    raw = json.dumps({"keys": ["stats:user:1"]}).encode()
    return raw + b" " * (size - len(raw))


async def test_touch_body_limit_is_413(make_node: NodeFactory) -> None:
    node = await make_node(worker=False, max_body=1024)
    assert await node.touch(_body_of_size(1024)) == (202, {"accepted": 1})

    status, body = await node.touch(_body_of_size(1025))
    assert status == 413
    assert "1024 bytes" in body["error"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: caught while reading
        yield b'{"keys": ["stats:user:2"'
        for _ in range(20):
            yield b" " * 100
        yield b"]}"

    status, body = await node.touch(chunked())
    assert status == 413
    await node.c.flush()
    status_now = await node.c.query.status()
    assert status_now["rules"]["user-stats"]["pending"] == 1  # only stats:user:1


async def test_default_body_limit_is_one_mib(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    assert (await node.touch(_body_of_size(1024 * 1024)))[0] == 202
    assert (await node.touch(_body_of_size(1024 * 1024 + 1)))[0] == 413


async def test_touch_buffer_full_is_503(own_server: ValkeyProcess,
                                        make_node: NodeFactory) -> None:
    server = own_server  # requested first: it outlives the node, and is stopped after
    try:
        node = await make_node(worker=False, url=server.url, max_buffered=1)
        server.kill()  # nothing can be flushed now: the one-key buffer fills and stays full

        numbers = itertools.count()

        async def refused() -> Any:
            status, body = await node.touch({"keys": [f"stats:user:{next(numbers)}"]})
            return body if status == 503 else None

        body = await wait_until(refused, timeout=10, message="a 503 from /touch")
        assert "already buffered" in body["error"]
    finally:
        server.start()  # so the node's final flush succeeds


# --- auth -----------------------------------------------------------------------------


@pytest.mark.parametrize("header", [
    None, "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer ",
])
async def test_a_token_is_required_on_every_route_but_healthz(
        make_node: NodeFactory, header: str | None) -> None:
    node = await make_node(worker=False, token=TOKEN)
    headers = {} if header is None else {"Authorization": header}
    for method, path in [("POST", "/touch"), ("GET", "/status"), ("GET", "/metrics"),
                         ("GET", "/nowhere")]:
        status, body, response = await node.request(
            method, path, headers=headers, json={"keys": ["stats:user:1"]})
        assert status == 401, (method, path)
        assert "bearer token" in body["error"]
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = await node.request("GET", "/healthz", headers=headers)
    assert (status, body) == (200, {"ok": True})
    assert await node.pending() == 0


async def test_the_right_token_is_let_in(make_node: NodeFactory) -> None:
    node = await make_node(worker=False, token=TOKEN)
    assert await node.touch({"keys": ["stats:user:1"]}, token=TOKEN) == (202, {"accepted": 1})
    status, _, _ = await node.request("GET", "/status", headers={
        "Authorization": f"bearer {TOKEN}"})  # the scheme is case-insensitive
    assert status == 200
    status, _, _ = await node.request("GET", "/metrics", token=TOKEN)
    assert status == 200


# --- GET /healthz, /status ------------------------------------------------------------


async def test_healthz_and_status(make_node: NodeFactory) -> None:
    node = await make_node()
    status, body, _ = await node.request("GET", "/healthz")
    assert (status, body) == (200, {"ok": True})

    async def led() -> Any:
        _, body, _ = await node.request("GET", "/status")
        return body if body["shards"][0]["leader"] == "n1" else None

    body = await wait_until(led, timeout=5, message="n1 leading shard 0 in /status")
    assert body["shards"][0]["shard"] == 0
    assert body["rules"]["user-stats"]["pending"] == 0
    assert body["rules"]["user-stats"]["in_flight"] == 0
    assert body["rules"]["user-stats"]["dead"] == 0
    assert body["shards"] == (await node.c.query.status())["shards"]


async def test_redis_down_is_503_on_healthz_and_status(own_server: ValkeyProcess,
                                                       make_node: NodeFactory) -> None:
    server = own_server  # requested first: it outlives the node, and is stopped after
    try:
        node = await make_node(worker=False, url=server.url)
        assert (await node.request("GET", "/healthz"))[0] == 200
        server.kill()
        status, body, _ = await node.request("GET", "/healthz")
        assert (status, body["ok"]) == (503, False)
        status, body, _ = await node.request("GET", "/status")
        assert status == 503
        assert "cannot read status" in body["error"]
        status, text, _ = await node.request("GET", "/metrics")  # still served, stale gauges
        assert status == 200
        assert "coalescer_touches_total" in text
        server.start()
        await wait_until(node.c.ping, timeout=10, message="reconnected")
        assert (await node.request("GET", "/healthz"))[0] == 200
    finally:
        server.start()


async def test_unknown_route_and_method_are_json_errors(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    status, body, _ = await node.request("GET", "/nowhere")
    assert status == 404
    assert body == {"error": "Not Found"}
    status, body, response = await node.request("GET", "/touch")
    assert status == 405
    assert "POST" in response.headers["Allow"]


# --- GET /metrics ---------------------------------------------------------------------


async def test_metrics_parse_and_move(make_node: NodeFactory) -> None:
    node = await make_node()

    async def scrape() -> str:
        status, text, response = await node.request("GET", "/metrics")
        assert status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        assert isinstance(text, str)
        return text

    before = await scrape()
    assert metric(before, "coalescer_touches_total") == 0
    assert metric(before, "coalescer_pending_keys", rule="user-stats") == 0
    names = {family.name for family in text_string_to_metric_families(before)}
    assert {"coalescer_touches", "coalescer_absorbed_touches", "coalescer_flushes",
            "coalescer_refreshes", "coalescer_refresh_duration_seconds",
            "coalescer_refresh_start_lag_seconds", "coalescer_pending_keys",
            "coalescer_in_flight_keys", "coalescer_dead_keys", "coalescer_shard_leader",
            "coalescer_redis_errors"} <= names

    keys = [f"stats:user:{i}" for i in range(5)]
    assert await node.touch({"keys": keys + keys}) == (202, {"accepted": 10})

    async def moved() -> str | None:
        text = await scrape()
        done = (metric(text, "coalescer_touches_total") == 10
                and metric(text, "coalescer_refreshes_total", rule="user-stats",
                           outcome="success") == 5)
        return text if done else None

    text = await wait_until(moved, timeout=10, message="counters to move")
    assert metric(text, "coalescer_absorbed_touches_total") >= 5
    assert metric(text, "coalescer_flushes_total") >= 1
    assert metric(text, "coalescer_refresh_duration_seconds_count", rule="user-stats") == 5
    assert metric(text, "coalescer_refresh_start_lag_seconds_count", rule="user-stats") == 5
    assert metric(text, "coalescer_shard_leader", shard="0") == 1
    # A scrape reads the gauges from Redis before it renders the counters, so the
    # scrape that first counts 5 refreshes may have read "pending" before they were
    # claimed. The next scrape reads Redis after all 5 were claimed: nothing pending.
    after = await scrape()
    assert metric(after, "coalescer_pending_keys", rule="user-stats") == 0


async def test_metrics_pending_gauge_comes_from_redis(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    assert (await node.touch({"keys": ["stats:user:1", "stats:user:2"]}))[0] == 202
    await node.c.flush()
    _, text, _ = await node.request("GET", "/metrics")
    assert metric(text, "coalescer_pending_keys", rule="user-stats") == 2


# --- DELETE /keys/{key} ----------------------------------------------------------------
# Sent body-less and without an Origin header, as a script or curl sends it.


async def test_delete_cancels_a_pending_key_then_answers_404(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    assert (await node.touch({"keys": ["stats:user:1", "stats:user:2"]}))[0] == 202
    await node.c.flush()

    status, body, _ = await node.request("DELETE", "/keys/stats:user:1")
    assert (status, body) == (200, {"cancelled": True, "key": "stats:user:1",
                                    "state": "pending"})
    assert await node.pending() == 1
    status, body, _ = await node.request("DELETE", "/keys/stats:user:1")
    assert status == 404
    assert body | {"error": ""} == {"error": "", "key": "stats:user:1", "cancelled": False,
                                    "state": "idle"}
    assert "not pending" in body["error"]

    _, explained, _ = await node.request("GET", "/keys/stats:user:1")
    assert explained["state"] == "idle"
    assert [r["outcome"] for r in explained["last_refreshes"]] == ["cancelled"]
    _, text, _ = await node.request("GET", "/metrics")
    assert metric(text, "coalescer_cancels_total", rule="user-stats") == 1


async def test_delete_drops_touches_the_node_still_buffers(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    node.c.touch("stats:user:1")  # buffered: the route runs before the flusher writes it
    status, body, _ = await node.request("DELETE", "/keys/stats:user:1")
    assert status == 200
    assert body["state"] in ("buffered", "pending")  # in Redis already, or not yet
    assert await node.pending() == 0


async def test_delete_of_a_key_no_rule_matches_is_404_and_of_an_unstorable_one_422(
        make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    status, body, _ = await node.request("DELETE", "/keys/nomatch:1")
    assert (status, body) == (404, {"error": "no rule matches key 'nomatch:1'",
                                    "key": "nomatch:1"})
    status, body, _ = await node.request("DELETE", "/keys/stats:user:%00")
    assert status == 422
    assert body["invalid_keys"][0]["key"] == "stats:user:\0"


async def test_a_key_over_the_length_limit_is_422_on_explain_and_cancel_not_matched(
        make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    long_key = "stats:user:" + "x" * 2000  # its rule's pattern would match it
    for method in ("GET", "DELETE"):
        status, body, _ = await node.request(method, "/keys/" + long_key)
        assert status == 422, (method, body)
        assert "over the limit of 1024" in body["invalid_keys"][0]["error"]


async def test_delete_needs_the_token_and_a_running_node(make_node: NodeFactory) -> None:
    node = await make_node(worker=False, token=TOKEN)
    assert (await node.touch({"keys": ["stats:user:1"]}, token=TOKEN))[0] == 202
    status, _, _ = await node.request("DELETE", "/keys/stats:user:1")
    assert status == 401
    await node.c.close()
    status, body, _ = await node.request("DELETE", "/keys/stats:user:1", token=TOKEN)
    assert status == 503
    assert "not running" in body["error"]


async def test_delete_while_redis_is_down_is_503(own_server: ValkeyProcess,
                                                 make_node: NodeFactory) -> None:
    server = own_server
    try:
        node = await make_node(worker=False, url=server.url)
        server.kill()
        status, body, _ = await node.request("DELETE", "/keys/stats:user:1")
        assert status == 503
        assert "cannot cancel" in body["error"]
    finally:
        server.start()


# --- lifecycle ------------------------------------------------------------------------


async def test_port_zero_binds_a_real_port_and_close_is_idempotent(
        make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    assert node.api.port > 0
    assert node.api.url == f"http://127.0.0.1:{node.api.port}"
    await node.api.close()
    await node.api.close()
    with pytest.raises(aiohttp.ClientConnectionError):
        await node.request("GET", "/healthz")


def test_max_body_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_body"):
        HttpApi(object(), max_body=0)  # type: ignore[arg-type]


async def test_an_item_refused_only_when_touched_is_still_a_422(
        make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The body's items are checked before anything is touched; should a check be
    missed there, the touch itself refuses the item, and the answer is the same 422."""
    node = await make_node(worker=False)
    monkeypatch.setattr(node.c, "refused_items", lambda pairs: [])
    status, answer = await node.touch({"items": [["stats:user:1", "o1"]]})
    assert status == 422
    assert answer["invalid_items"] == [{"key": "stats:user:1", "item": "o1",
                                        "error": answer["invalid_items"][0]["error"]}]
    assert "takes no items" in answer["error"]
    assert await node.pending() == 0
