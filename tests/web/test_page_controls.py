"""The status page's controls in a real headless Chromium, on a real worker node: the
Pause button holds a rule (its row says paused; its keys keep their touches and none
runs), Run now runs a key whose window has an hour to go, Resume runs what waited."""

from __future__ import annotations

from coalescer.query.history import HistoryQuery
from tests.helpers.browser import Browser
from tests.helpers.servers import wait_until
from tests.web.test_page import (  # noqa: F401 (chromium, make_node: fixtures)
    NodeFactory,
    PageNode,
    chromium,
    make_node,
)


async def refreshed(node: PageNode, key: str) -> bool:
    return any(r.outcome == "success" for r in await node.c.query.history(HistoryQuery(key=key)))


async def due_now(node: PageNode, key: str) -> bool:
    info = await node.c.query.explain(key)
    return info["state"] == "pending" and info["due_ms"] <= info["now_ms"]


async def click(browser: Browser, selector: str) -> None:
    await browser.wait_for(f"document.querySelector({selector!r})",
                           message=f"{selector} on the page")
    await browser.evaluate(f"document.querySelector({selector!r}).click()")


async def message_after(browser: Browser, clicks: int) -> str:
    """The control message once ``clicks`` controls have answered."""
    text: str = await browser.wait_for(
        f"document.querySelector('#control-msg[data-done=\"{clicks}\"]')?.textContent")
    return text


async def test_the_page_pauses_a_rule_runs_a_key_now_and_resumes(
        chromium: str, make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(shards=1)
    await wait_until(lambda: node.c.leads() == [0], message="the node to lead its shard")
    node.c.touch("later:1")  # its window: an hour
    await node.c.flush()
    async with Browser(chromium) as browser:
        await browser.goto(node.api.url + "/")
        await click(browser, "tr[data-rule='agg'] button.pause")
        assert await message_after(browser, 1) == "agg paused"
        assert await node.c.query.paused() == ["agg"]
        await browser.wait_for("document.querySelector(\"tr[data-rule='agg'] .paused\")",
                               message="the row to say paused")
        await browser.wait_for("document.querySelector(\"tr[data-rule='agg'] button.resume\")")
        await wait_until(lambda: node.c.metrics.registry.get_sample_value(
            "coalescer_rule_paused", {"rule": "agg"}) == 1)

        node.c.touch("agg:1")
        await node.c.flush()
        await wait_until(lambda: due_now(node, "agg:1"), message="agg:1 due")
        await click(browser, "#due tr[data-key='later:1'] button.run-now")
        assert await message_after(browser, 2) == "due now: later:1"
        await wait_until(lambda: refreshed(node, "later:1"), message="later:1 run now")
        assert not await refreshed(node, "agg:1")  # due before later:1, and paused

        await click(browser, "tr[data-rule='agg'] button.resume")
        assert await message_after(browser, 3) == "agg resumed"
        await wait_until(lambda: refreshed(node, "agg:1"), message="agg:1 once resumed")
        await browser.wait_for("document.querySelector(\"tr[data-rule='agg'] button.pause\")"
                               " && !document.querySelector(\"tr[data-rule='agg'] .paused\")",
                               message="the row to say it runs again")
        assert await browser.evaluate("document.body.dataset.pwned") is None


async def test_a_refused_control_says_why_on_the_page(
        chromium: str, make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(shards=1, worker=False)
    node.c.touch("later:1")
    await node.c.flush()
    async with Browser(chromium) as browser:
        await browser.goto(node.api.url + "/")
        await browser.wait_for("document.querySelector(\"#due tr[data-key='later:1']\")")
        await node.c.cancel("later:1")  # gone before the click: the node answers 404
        await click(browser, "#due tr[data-key='later:1'] button.run-now")
        assert await message_after(browser, 1) == (
            "run later:1 now refused (404): key 'later:1' is not pending (idle); "
            "nothing was run")
