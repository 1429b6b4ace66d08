"""With no worker node running, GET /status, GET /keys/{key} and the status page (in a
real headless Chromium) say that nothing refreshes the rule's keys and no node reads
the sources; once a worker node starts, they stop saying it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.helpers.inspection import write
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 60s
    max_wait: 2m
    handler: {{mod}}:refresh
sources:
  - {{name: events, stream: "{ns}-events", key: "stats:{{id}}"}}
"""

MARKS = "document.querySelectorAll('#rules .no-worker, #sources .unread').length"


async def get(api: HttpApi, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(api.url + path) as answer:
        assert answer.status == 200
        return json.loads(await answer.text())


async def test_the_json_and_the_page_say_no_worker_runs_until_one_starts(
        chromium: str, redis_url: str, namespace: str, tmp_path: Path) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        c.touch("stats:1")
        await c.flush()
        api = HttpApi(c, port=0)
        await api.start()
        try:
            status = await get(api, "/status")
            assert status["rules"]["stats"]["no_worker"] is True
            assert status["sources"]["events"]["unread"] is True
            key = await get(api, "/keys/stats:1")
            assert key["no_worker"] is True and key["unread_sources"] == ["events"]
            async with Browser(chromium) as browser:
                await browser.goto(api.url + "/")
                await browser.wait_for("document.querySelector('#rules .no-worker')",
                                       message="the rule marked")
                assert await browser.evaluate(
                    "document.querySelector(\"tr[data-rule='stats'] .no-worker\").textContent"
                ) == "no worker is running for this rule"
                assert await browser.evaluate(
                    "document.querySelector('#no-worker-msg').textContent") == (
                    "no worker is running: no node has renewed its lease; pending keys will "
                    "not be refreshed, and no source is read, until one starts (coalescer run)")
                assert await browser.evaluate(
                    "document.querySelector(\"tr[data-source='events'] .unread\").textContent"
                ) == "its events are not being read: no worker is running"

                async with Coalescer.from_yaml(rules, redis_url=redis_url, grace=0.5):
                    await browser.wait_for(f"{MARKS} === 0", message="the marks gone")
                    assert await browser.evaluate(
                        "document.querySelector('#no-worker-msg').hidden") is True
                    assert (await get(api, "/keys/stats:1"))["no_worker"] is False
        finally:
            await api.close()
