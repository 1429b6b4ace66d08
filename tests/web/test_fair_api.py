"""GET and POST /rules/{rule}/fair over real HTTP against a real coalescer: a fair
rule's weights and cap read and changed at runtime (every shard's copy written before
the answer, audited), the errors, and the guards every state change gets."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from tests.helpers.servers import free_port

TOKEN = "s3cret-operator-token-0123456789"
RULES = """\
namespace: {ns}
shards: 3
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    handler: {{http: {{url: "http://127.0.0.1:9/"}}}}
    fair: {{by: "{{org}}", weights: {{acme: 2}}, max_running: 4}}
  - name: plain
    match: "p:{{id}}"
    handler: {{http: {{url: "http://127.0.0.1:9/"}}}}
"""


class Api:
    def __init__(self, c: Coalescer, api: HttpApi, http: aiohttp.ClientSession) -> None:
        self.c, self.api, self.http = c, api, http

    async def call(self, method: str, path: str, body: Any = None, *,
                   token: str | None = None, headers: dict[str, str] | None = None,
                   data: bytes | None = None) -> tuple[int, Any]:
        sent = dict(headers or {})
        if token:
            sent["Authorization"] = f"Bearer {token}"
        async with self.http.request(method, f"http://127.0.0.1:{self.api.port}{path}",
                                     json=body if data is None else None, data=data,
                                     headers=sent) as response:
            return response.status, await response.json(content_type=None)


Factory = Callable[..., Awaitable[Api]]


@pytest_asyncio.fixture
async def make_api(redis_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Factory]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(RULES.format(ns=namespace)))
    opened: list[tuple[Coalescer, HttpApi, aiohttp.ClientSession]] = []

    async def make(**options: Any) -> Api:
        c = Coalescer.from_yaml(rules, redis_url=redis_url, worker=False)
        await c.start()
        api = HttpApi(c, port=0, **options)
        await api.start()
        http = aiohttp.ClientSession()
        opened.append((c, api, http))
        return Api(c, api, http)

    yield make
    for c, api, http in reversed(opened):
        await http.close()
        await api.close()
        await c.close()


async def test_get_shows_the_rules_files_settings_and_post_changes_them_everywhere(
        make_api: Factory, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    api = await make_api()
    status, body = await api.call("GET", "/rules/tenants/fair")
    assert (status, body["weights"], body["max_running"]) == (200, {"acme": 2.0}, 4)

    with caplog.at_level(logging.INFO, logger="coalescer.common.audit_log"):
        status, body = await api.call("POST", "/rules/tenants/fair",
                                      {"weights": {"small": 0.5, "acme": 5}, "max_running": 2})
    assert status == 200, body
    assert body["weights"] == {"acme": 5.0, "small": 0.5} and body["max_running"] == 2
    assert body["runtime_weights"] == {"acme": 5.0, "small": 0.5}
    assert any("operator action: fair rule tenants: 1 changed" in r.getMessage()
               for r in caplog.records)
    for shard in KeySpace(namespace, 3).all_shards():  # the copies the claims read
        assert await api.c.redis.hgetall(shard.fair("tenants") + "conf") == {
            "w:acme": "5.0", "w:small": "0.5", "cap": "2"}

    status, body = await api.call("POST", "/rules/tenants/fair", {"max_running": 0})
    assert (status, body["max_running"]) == (200, None)  # the cap lifted
    status, body = await api.call("POST", "/rules/tenants/fair", {"reset": True})
    assert (body["weights"], body["max_running"], body["runtime_weights"]) == (
        {"acme": 2.0}, 4, {})
    for shard in KeySpace(namespace, 3).all_shards():
        assert await api.c.redis.hgetall(shard.fair("tenants") + "conf") == {}


@pytest.mark.parametrize(("body", "fragment"), [
    ({"weights": {"a": 0}}, "weight for 'a': a weight must be a number above 0"),
    ({"weights": {"a": "x"}}, "got 'x'"),
    ({"weights": {"a:b": 1}}, "without ':'"),
    ({"weights": ["a"]}, "'weights' must be an object"),
    ({"max_running": -1}, "max_running must be a whole number"),
    ({"max_running": 1.5}, "got 1.5"),
    ({"reset": "yes"}, "'reset' must be true or false"),
    ({"weight": {"a": 1}}, "unknown field 'weight'"),
    ([1], "must be a JSON object"),
])
async def test_a_bad_body_is_400_naming_the_problem_and_changes_nothing(
        make_api: Factory, body: Any, fragment: str) -> None:
    api = await make_api()
    status, answer = await api.call("POST", "/rules/tenants/fair", body)
    assert status == 400 and fragment in answer["error"], answer
    status, answer = await api.call("GET", "/rules/tenants/fair")
    assert answer["runtime_weights"] == {} and answer["runtime_max_running"] is False


async def test_a_rule_without_fair_is_409_and_an_unknown_rule_404(make_api: Factory) -> None:
    api = await make_api()
    status, body = await api.call("POST", "/rules/plain/fair", {"weights": {"a": 2}})
    assert status == 409 and "has no fair:" in body["error"]
    status, body = await api.call("GET", "/rules/nope/fair")
    assert status == 404 and body["rules"] == ["tenants", "plain"]


async def test_a_change_needs_the_token_and_passes_the_cross_site_and_json_guards(
        make_api: Factory) -> None:
    api = await make_api(token=TOKEN)
    change = {"weights": {"x": 3}}
    assert (await api.call("POST", "/rules/tenants/fair", change))[0] == 401
    status, _ = await api.call("POST", "/rules/tenants/fair", change, token=TOKEN,
                               headers={"Origin": f"http://127.0.0.1:{free_port()}"})
    assert status == 403
    status, _ = await api.call("POST", "/rules/tenants/fair", token=TOKEN, data=b"x=3",
                               headers={"Content-Type": "text/plain"})
    assert status == 415
    status, body = await api.call("GET", "/rules/tenants/fair", token=TOKEN)
    assert status == 200 and body["runtime_weights"] == {}
    status, body = await api.call("POST", "/rules/tenants/fair", change, token=TOKEN)
    assert status == 200 and body["runtime_weights"] == {"x": 3.0}
