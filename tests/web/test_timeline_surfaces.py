"""A key's timeline where people read it: ``coalescer timeline KEY [--at T]`` (output and
exit codes), ``GET /keys/{key}/timeline`` (its JSON and its errors), and the status page
in a real headless Chromium (a key's link on the page shows its timeline)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import quote

import pytest

from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.query.history import HistoryQuery
from coalescer.store.keys import ShardKeys
from coalescer.store.scripts import Scripts
from coalescer.tracing.bounds import KEEP
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.helpers.inspection import node, write
from tests.helpers.servers import wait_until
from tests.query.test_timeline import RULES
from tests.web.test_page import (  # noqa: F401 (chromium, make_node: fixtures)
    NodeFactory,
    PageNode,
    chromium,
    make_node,
)

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _touch_and_trace(rules: Path, redis_url: str, namespace: str) -> None:
    """ok:1 pending (its window is a minute), with a touch's trace context kept."""
    async def run() -> None:
        async with node(rules, redis_url, worker=False) as c:
            c.touch("ok:1")
            await c.flush()
            redis = c.query._redis  # the coalescer's own client
            await Scripts(redis).traces_put(ShardKeys(namespace, 0), {"ok:1": f"0|{TRACE}||"},
                                            KEEP, 60_000)
    asyncio.run(run())


def test_cli_timeline_output_json_and_answers(
        tmp_path: Path, redis_url: str, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    _touch_and_trace(rules, redis_url, namespace)
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["timeline", *base, "ok:1", "--at", "1700000000",
                 "--trace-url", "https://jaeger.example/trace/{trace_id}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok:1  (rule later, shard 0; state pending)")
    assert "touched 1 time in this second" in out
    assert "touch     https://jaeger.example/trace/0af7651916cd43dd8448eb211c80319c" in out
    assert ": not yet refreshed: pending, due at" in out
    assert main(["timeline", *base, "ok:1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"key", "rule", "shard", "now_ms", "kept", "state", "events", "runs",
                         "traces"}
    assert info["state"]["state"] == "pending" and info["runs"] == []
    assert info["events"][0]["type"] == "touches" and info["events"][0]["count"] == 1
    assert info["traces"]["touches"] == [{"trace_id": TRACE[3:35], "span_id": TRACE[36:52],
                                          "url": None}]


def test_cli_timeline_refuses_bad_input_with_what_was_wrong(
        tmp_path: Path, redis_url: str, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["timeline", *base, "nomatch:1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"coalescer timeline: no rule in {rules} matches key 'nomatch:1'"]
    assert main(["timeline", *base, "ok:" + "x" * 1100]) == 2
    assert "cannot be stored: it is 1103 characters long" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_at:
        main(["timeline", *base, "ok:1", "--at", "yesterday"])
    assert bad_at.value.code == 2
    assert "argument --at: 'yesterday' is not a time" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_template:
        main(["timeline", *base, "ok:1", "--trace-url", "https://j/{trace_id}/{x}"])
    assert bad_template.value.code == 2
    assert "an unknown placeholder {x}" in capsys.readouterr().err


async def test_http_timeline_json_and_errors(tmp_path: Path, redis_url: str, namespace: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    monkeypatch.setenv("COALESCER_TRACE_URL", "https://tempo.example/t/{trace_id}?s={span_id}")
    async with node(rules, redis_url, worker=False) as c, HttpApi(c, port=0) as api:
        c.touch("ok:1")
        await c.flush()
        await Scripts(c.query._redis).traces_put(ShardKeys(namespace, 0),
                                                 {"ok:1": f"0|{TRACE}||"}, KEEP, 60_000)
        page = PageNode(c, api, "")
        status, body = await page.get("/keys/ok%3A1/timeline")
        assert status == 200 and body["traces"]["touches"][0]["url"] == (
            f"https://tempo.example/t/{TRACE[3:35]}?s={TRACE[36:52]}")
        monkeypatch.setenv("COALESCER_TRACE_URL", "https://tempo.example/t/{nope}")
        status, body = await page.get("/keys/ok%3A1/timeline")  # a bad template: no urls
        assert status == 200 and body["traces"]["touches"][0]["url"] is None
        status, body = await page.get("/keys/ok%3A1/timeline?at=1700000000")
        assert status == 200 and body["key"] == "ok:1" and body["rule"] == "later"
        assert body["at"]["status"] == "pending" and body["at"]["at_ms"] == 1_700_000_000_000
        assert [e["type"] for e in body["events"]] == ["touches"]
        status, explain = await page.get("/keys/ok%3A1")  # the explain route still answers
        assert status == 200 and explain["state"] == "pending"
        status, body = await page.get("/keys/ok%3A1/timeline?at=soon")
        assert status == 400 and "'at'" in body["error"] and "not a time" in body["error"]
        status, body = await page.get("/keys/nomatch%3A1/timeline")
        assert status == 404 and body["error"] == "no rule matches key 'nomatch:1'"
        status, body = await page.get("/keys/" + quote("ok:" + "x" * 1100) + "/timeline")
        assert status == 422 and "cannot be stored" in body["error"]


async def test_the_page_shows_a_keys_timeline(chromium: str,  # noqa: F811
                                              make_node: NodeFactory) -> None:  # noqa: F811
    page = await make_node(shards=1)
    c: Coalescer = page.c
    c.touch("later:1")  # a window of an hour: listed among the due keys
    c.touch("agg:1")
    await c.flush()

    async def refreshed() -> bool:
        return any(r.outcome == "success"
                   for r in await c.query.history(HistoryQuery(key="agg:1")))
    await wait_until(refreshed, message="agg:1 refreshed")
    async with Browser(chromium) as browser:
        await browser.goto(page.api.url + "/")
        link = "#due a.timeline-link[data-key='later:1']"
        await browser.wait_for(f"document.querySelector({link!r})", message="the key's link")
        await browser.evaluate(f"document.querySelector({link!r}).click()")
        await browser.wait_for("document.querySelector('#timeline-msg[data-done=\"1\"]')")
        assert (await browser.evaluate("document.querySelector('#timeline-msg').textContent")
                ).startswith("later:1: pending, rule later")
        kinds = await browser.evaluate(
            "[...document.querySelectorAll('#timeline tbody tr')].map(r => r.dataset.type)")
        assert kinds == ["touches"]
        await browser.evaluate("document.querySelector('#timeline-key').value = 'agg:1';"
                               "document.querySelector('#timeline-at').value = '1700000000';"
                               "document.querySelector('#timeline-go').click()")
        await browser.wait_for("document.querySelector('#timeline-msg[data-done=\"2\"]')")
        kinds = await browser.evaluate(
            "[...document.querySelectorAll('#timeline tbody tr')].map(r => r.dataset.type)")
        assert kinds == ["touches", "claim", "outcome"]
        answer = await browser.evaluate("document.querySelector('#timeline-answer').textContent")
        assert answer.startswith("covered by the refresh claimed at")
        assert "node page-node-1" in answer
