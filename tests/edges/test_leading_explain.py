"""``edge: leading`` as a user reads it: `coalescer explain KEY` (text and ``--json``)
and the HTTP API's ``GET /keys/{key}`` name the rule's edge and say a quiet key's
refresh is due at its first touch; a trailing key of the same rules says neither (no
worker runs, so each key stays pending while it is read). A key's timeline says its
leading refresh was due at once. A real server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.query.timeline_text import format_timeline
from coalescer.web.api import HttpApi
from tests.conftest import Start
from tests.helpers.e2e import settled
from tests.helpers.inspection import write
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
defaults:
  window: 60s
  max_wait: 2m
rules:
  - name: lead
    match: "lead:{{id}}"
    edge: leading
    handler: {{mod}}:refresh
  - name: trail
    match: "trail:{{id}}"
    handler: {{mod}}:refresh
"""

LEADING_LINE = "edge: leading (a quiet key's first touch runs at once)"
LEADING_DUE = "by the leading edge: the first touch of a quiet key runs at once"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_coalescer_explain_shows_the_edge_and_a_leading_due_time(
        tmp_path: Path, redis_url: str, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    base = ("--rules", str(rules), "--redis", redis_url)
    run(capsys, "touch", *base, "lead:1", "trail:1")

    text = run(capsys, "explain", *base, "lead:1")
    assert LEADING_LINE in text
    assert LEADING_DUE in text
    found = json.loads(run(capsys, "explain", *base, "lead:1", "--json"))
    assert (found["state"], found["due_reason"], found["rule"]["edge"]) == (
        "pending", "leading", "leading")
    assert found["due_ms"] == found["first_touch_ms"]

    text = run(capsys, "explain", *base, "trail:1")
    assert "edge: leading" not in text and "leading edge" not in text
    found = json.loads(run(capsys, "explain", *base, "trail:1", "--json"))
    assert (found["due_reason"], found["rule"]["edge"]) == ("window", "trailing")
    assert found["due_ms"] == found["last_touch_ms"] + 60_000


@pytest_asyncio.fixture
async def api_node(tmp_path: Path, redis_url: str, namespace: str,
                   ) -> AsyncIterator[tuple[Coalescer, str]]:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    c = Coalescer.from_yaml(rules, redis_url=redis_url, worker=False, node_id="n1")
    await c.start()
    api = HttpApi(c, port=0)
    await api.start()
    try:
        yield c, f"http://127.0.0.1:{api.port}"
    finally:
        await api.close()
        await c.close()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.json()


async def test_http_get_key_shows_the_edge_and_a_leading_due_time(
        api_node: tuple[Coalescer, str]) -> None:
    c, url = api_node
    c.touch("lead:1")
    c.touch("trail:1")
    await c.flush()

    status, found = await get_json(f"{url}/keys/lead:1")
    assert status == 200
    assert (found["state"], found["due_reason"], found["rule"]["edge"]) == (
        "pending", "leading", "leading")
    assert found["due_ms"] == found["first_touch_ms"]

    status, found = await get_json(f"{url}/keys/trail:1")
    assert status == 200
    assert (found["state"], found["due_reason"], found["rule"]["edge"]) == (
        "pending", "window", "trailing")
    assert found["due_ms"] == found["last_touch_ms"] + 60_000


async def test_the_timeline_says_a_leading_refresh_was_due_at_once(
        tmp_path: Path, redis_url: str, redis_client: Any, namespace: str,
        start: Start) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    c = await start(rules, redis_url=redis_url, node_id="n1")
    c.touch("lead:1")
    await c.flush()
    await wait_until(lambda: settled(redis_client, namespace), timeout=10,
                     message="the leading refresh done and acked")
    info = await c.query.timeline("lead:1")
    [claim] = [e for e in info["events"] if e["type"] == "claim"]
    assert claim["due_reason"] == "leading"
    assert claim["due_ms"] == claim["first_touch_ms"]
    assert "at once: the first touch of a quiet key (the leading edge)" in format_timeline(
        info)
