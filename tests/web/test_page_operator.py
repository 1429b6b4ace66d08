"""The page's key search, bulk action and audit panel in a real headless Chromium, on a
real node with named tokens: an operator finds keys by capture, confirms the counted
keys and retries them, and sees it in the audit log; a read-only viewer searches but
is shown no action."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from coalescer.web.roles import ApiToken
from tests.helpers.browser import Browser
from tests.web.test_page import chromium  # noqa: F401 (a fixture)

OPS, VIEW = "ops-page-secret", "view-page-secret"
RULES = """\
namespace: {ns}
shards: 2
defaults: {{window: 1h, max_wait: 2h}}
rules:
  - name: acct
    match: "acct:{{org}}:{{user}}"
    handler: builtins:repr
"""

NOW_MS = int(time.time() * 1000)  # dead letters of now: none past dead_letter_ttl


@pytest_asyncio.fixture
async def node(tmp_path: Path, namespace: str, redis_url: str) -> AsyncIterator[HttpApi]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace))
    c = Coalescer.from_yaml(rules, redis_url=redis_url, worker=False)
    await c.start()
    space = KeySpace(namespace, 2)
    for n, key in enumerate(f"acct:{org}:{u}" for org in (1, 2) for u in range(6)):
        sk = space.shard(space.shard_of(key))
        await c.redis.hset(sk.meta, key, "D|1|1|5|boom")
        await c.redis.zadd(sk.dead("acct"), {key: NOW_MS + n})
    c.touch("acct:3:1")
    await c.flush()
    api = HttpApi(c, port=0, tokens=[ApiToken("ops", "operator", OPS),
                                     ApiToken("viewer", "read", VIEW)])
    await api.start()
    yield api
    await api.close()
    await c.close()


async def signed_in(browser: Browser, api: HttpApi, token: str, role: str) -> None:
    await browser.goto(api.url + "/")
    await browser.wait_for("document.querySelector('#token-form.shown')")
    await browser.evaluate(f"document.querySelector('#token').value = {json.dumps(token)};"
                           "document.querySelector('#token-form').requestSubmit()")
    await browser.wait_for(f"document.body.dataset.role === {json.dumps(role)}")


async def searched(browser: Browser, where: str, state: str, done: int) -> int:
    await browser.evaluate(f"$('search-rule').value = 'acct'; $('search-where').value = "
                           f"{json.dumps(where)}; $('search-state').value = {json.dumps(state)};"
                           "$('search-go').click()")
    await browser.wait_for(f"document.querySelector('#search-msg[data-done=\"{done}\"]')")
    rows: int = await browser.evaluate(
        "document.querySelectorAll('#search-results tr[data-key]').length")
    return rows


def shown(selector: str) -> str:
    return (f"[...document.querySelectorAll({json.dumps(selector)})]"
            ".some((e) => getComputedStyle(e).display !== 'none')")


async def test_an_operator_searches_confirms_the_count_and_retries_and_it_is_audited(
        chromium: str, node: HttpApi) -> None:  # noqa: F811
    async with Browser(chromium) as browser:
        await signed_in(browser, node, OPS, "operator")
        assert await searched(browser, "", "dead", 1) == 12  # declined: nothing is done
        await browser.evaluate("window.confirm = () => false; $('bulk-action').value = 'purge';"
                               "$('bulk-go').click()")
        await browser.wait_for("document.querySelector('#bulk-msg[data-done=\"1\"]')")
        assert await browser.evaluate("$('bulk-msg').textContent") == (
            "nothing done (12 keys found)")
        assert await searched(browser, "org=2", "dead", 2) == 6
        assert (await browser.evaluate("$('search-msg').textContent")).startswith("6 keys found")
        await browser.evaluate("window.confirm = (m) => { document.body.dataset.asked = m; "
                               "return true; }; $('bulk-action').value = 'retry';"
                               "$('bulk-go').click()")
        await browser.wait_for("document.querySelector('#bulk-msg[data-done=\"2\"]')")
        assert await browser.evaluate("document.body.dataset.asked") == (
            "retry 6 keys (the dead keys found by this search)?")
        assert await browser.evaluate("$('bulk-msg').textContent") == (
            "retry done: 6 of 6 matched")
        await browser.wait_for(
            "[...document.querySelectorAll('#audit tr[data-audit]')].some((r) => "
            "r.textContent.includes('token ops') && r.textContent.includes("
            "'retry the dead keys of rule acct where org=2'))")
        assert await searched(browser, "org=2", "dead", 3) == 0
        assert await searched(browser, "org=1", "dead", 4) == 6
        assert await browser.evaluate(shown("#bulk-box"))


async def test_a_read_only_viewer_searches_and_sees_no_action(
        chromium: str, node: HttpApi) -> None:  # noqa: F811
    async with Browser(chromium) as browser:
        await signed_in(browser, node, VIEW, "read")
        await browser.wait_for("document.querySelector('body.read-only')")
        await browser.wait_for("document.querySelector('#due tr[data-key] button.run-now')")
        await browser.wait_for("document.querySelector('#dead tr[data-key] button.retry')")
        for selector in ("#bulk-box", "button.run-now", "button.pause", "button.retry",
                         "#retry-all"):
            assert not await browser.evaluate(shown(selector)), selector
        assert await searched(browser, "org=1", "dead", 1) == 6
        assert await browser.evaluate(shown("#search-form"))
