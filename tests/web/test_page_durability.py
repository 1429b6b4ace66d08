"""A deployment that asks for a replica its Redis does not have: GET /status and the
status page (in a real headless Chromium) say what the writes wait for and how to fix
it; with a replica attached, they stop saying it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.helpers.inspection import write
from tests.helpers.servers import ValkeyProcess, replica_of
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]

RULES = """\
namespace: {ns}
durability: {{replicas: 1, timeout: 200ms}}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 60s
    max_wait: 2m
    handler: {{mod}}:refresh
"""

SAID = ("durability unmet: waiting for 1 replica: the primary has 0 connected replicas; "
        "add a replica or lower durability.replicas")
BANNER = "document.querySelector('#durability-msg')"


async def get(api: HttpApi, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(api.url + path) as answer:
        assert answer.status == 200
        return json.loads(await answer.text())


async def test_the_json_and_the_page_say_the_replica_is_missing_until_one_is_attached(
        chromium: str, own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    async with Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False) as c, \
            HttpApi(c, port=0) as api:
        durability = (await get(api, "/status"))["durability"]
        assert durability["unmet"] is True and durability["replicas"] == 1
        async with Browser(chromium) as browser:
            await browser.goto(api.url + "/")
            await browser.wait_for(f"!{BANNER}.hidden", message="the banner shown")
            assert await browser.evaluate(f"{BANNER}.textContent") == SAID

            replica = await asyncio.to_thread(replica_of, own_server, tmp_path / "replica")
            try:
                await browser.wait_for(f"{BANNER}.hidden", message="the banner gone")
                assert (await get(api, "/status"))["durability"]["problem"] is None
            finally:
                await asyncio.to_thread(replica.stop)
