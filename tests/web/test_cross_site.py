"""Real attacks from a real headless Chromium: a page on another origin (another port of
127.0.0.1) tries to touch keys and retry a dead letter on a node without a token, and
the status page keeps working under its Content-Security-Policy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio
from aiohttp import web

from coalescer.store.keys import KeySpace
from tests.helpers.browser import Browser
from tests.helpers.servers import wait_until
from tests.web.test_page import (  # noqa: F401 (chromium, make_node: fixtures)
    HOSTILE,
    NodeFactory,
    PageNode,
    chromium,
    make_node,
    populated,
    show_page,
)

FETCHED = "later:evil-fetch"
FORMED = "later:evil=form"  # a text/plain form sends NAME=VALUE: the '=' lands in the key

# A form posting `enctype="text/plain"` sends "NAME=VALUE\r\n": split a JSON body at
# its first "=" and the receiver gets that JSON. Each form posts into its own frame;
# each frame's load (the node answered) is counted on <body data-answers>.
ATTACKER_PAGE = """<!doctype html>
<html><body data-answers="0">
<iframe name="f-touch"></iframe><iframe name="f-retry"></iframe>
<script>
const NODE = %(node)s;
function form(path, frame, body) {
  const cut = body.indexOf("=");
  const f = document.createElement("form");
  f.method = "POST"; f.enctype = "text/plain"; f.action = NODE + path; f.target = frame;
  const input = document.createElement("input");
  input.type = "hidden"; input.name = body.slice(0, cut); input.value = body.slice(cut + 1);
  f.append(input);
  document.body.append(f);
  document.querySelector("iframe[name=" + frame + "]").addEventListener("load", () => {
    document.body.dataset.answers = String(Number(document.body.dataset.answers) + 1);
  });
  f.submit();
}
window.addEventListener("load", () => {
  form("/touch", "f-touch", JSON.stringify({keys: [%(formed)s]}));
  form("/dead/retry", "f-retry", JSON.stringify({keys: [%(dead)s]}));
});
</script>
</body></html>
"""

NO_CORS = """
Promise.all(%(calls)s.map(([path, key]) => fetch(%(node)s + path, {
  method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
  body: JSON.stringify({keys: [key]})}).then((answer) => answer.type)))
"""


@pytest_asyncio.fixture
async def attacker() -> AsyncIterator[list[str]]:
    """A web server on another port of 127.0.0.1 (another origin); the list holds the
    node URL its page attacks, set by the test before the page is loaded."""
    target: list[str] = []

    async def page(request: web.Request) -> web.Response:
        html = ATTACKER_PAGE % {"node": json.dumps(target[0]), "formed": json.dumps(FORMED),
                                "dead": json.dumps(HOSTILE)}
        return web.Response(text=html, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    target.append(f"http://127.0.0.1:{runner.addresses[0][1]}/")
    try:
        yield target
    finally:
        await runner.cleanup()


async def touched(node: PageNode, client: redis.asyncio.Redis, namespace: str,
                  key: str) -> bool:
    await node.c.flush()
    keys = KeySpace(namespace, node.c.config.shards)
    return await client.zscore(keys.shard(keys.shard_of(key)).due("later"), key) is not None


async def test_a_page_on_another_origin_cannot_touch_or_retry(
        chromium: str, make_node: NodeFactory, attacker: list[str],  # noqa: F811
        redis_client: redis.asyncio.Redis, namespace: str) -> None:
    node = await populated(make_node, shards=2)
    node.handlers.failing = False  # a retried key would now succeed
    page_url = attacker.pop()
    attacker.append(node.api.url)
    async with Browser(chromium) as browser:
        await browser.goto(page_url)
        await browser.wait_for("document.body.dataset.answers === '2'",
                               message="both forms answered by the node")
        calls = json.dumps([["/touch", FETCHED], ["/dead/retry", HOSTILE]])
        answers = await browser.evaluate(NO_CORS % {"calls": calls,
                                                    "node": json.dumps(node.api.url)})
        assert answers == ["opaque", "opaque"]  # sent, and answered
    outcome = {"fetch touched": await touched(node, redis_client, namespace, FETCHED),
               "form touched": await touched(node, redis_client, namespace, FORMED),
               "still dead": await node.dead(HOSTILE),
               "refreshed": list(node.handlers.succeeded)}
    assert outcome == {"fetch touched": False, "form touched": False, "still dead": True,
                       "refreshed": []}


async def test_the_page_runs_under_its_csp_without_a_violation(
        chromium: str, make_node: NodeFactory) -> None:  # noqa: F811
    node = await populated(make_node, shards=1)
    async with Browser(chromium) as browser:
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=(
            "window.violations = [];"
            "document.addEventListener('securitypolicyviolation', "
            "(e) => window.violations.push(e.violatedDirective + ' ' + e.blockedURI));"))
        await show_page(browser, node)  # its script ran: the dead letter is shown
        await browser.wait_for("Number(document.body.dataset.updates) >= 2")
        assert await browser.evaluate("getComputedStyle(document.body).margin") == "0px"
        node.handlers.failing = False
        await browser.evaluate("document.querySelector('#dead button.retry').click()")
        assert "re-queued 1 key" in await browser.wait_for(
            "document.querySelector('#retry-msg[data-done]')?.textContent")
        assert await browser.evaluate("window.violations") == []

        # the policy is enforced: a script injected into the page does not run
        await browser.evaluate("const s = document.createElement('script');"
                               "s.textContent = 'document.body.dataset.injected = 1';"
                               "document.body.append(s)")
        await wait_until(lambda: browser.evaluate("window.violations.length"), timeout=10,
                         message="the injected script's violation")
        assert await browser.evaluate("document.body.dataset.injected") is None
        assert (await browser.evaluate("window.violations"))[0].startswith("script-src")
