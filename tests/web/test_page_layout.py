"""The status page's layout in a real headless Chromium at common desktop widths: with
scheduled keys on every rule, each rule's Next due and its Pause button stay in view
(the rules table never overflows its panel)."""

from __future__ import annotations

import pytest

from tests.helpers.browser import Browser
from tests.web.test_page import (  # noqa: F401 (chromium, make_node: fixtures)
    NodeFactory,
    chromium,
    make_node,
)

IN_VIEW = """(() => {
  const panel = document.querySelector('#rules').closest('section').getBoundingClientRect();
  const right = Math.min(panel.right, window.innerWidth);
  return [...document.querySelectorAll('#rules tbody tr[data-rule]')].flatMap(tr => {
    const due = tr.children[6].getBoundingClientRect();
    const button = tr.querySelector('button').getBoundingClientRect();
    return [[tr.dataset.rule + ' next due', due.left >= panel.left && due.right <= right],
            [tr.dataset.rule + ' button', button.left >= panel.left && button.right <= right]];
  }).filter(([, shown]) => !shown).map(([what]) => what);
})()"""


@pytest.mark.parametrize("width", [1280, 1440, 1920])
async def test_next_due_and_the_pause_button_stay_in_view_with_scheduled_keys(
        chromium: str, make_node: NodeFactory, width: int) -> None:  # noqa: F811
    node = await make_node(shards=2)
    for i, rule in enumerate(("agg", "later", "flaky", "bulk")):
        node.c.touch_many([f"{rule}:{n}" for n in range(1200)], delay=f"{300 + i}d")
    node.c.touch("later:soon")  # a key due without a time of its own: a Next due
    await node.c.flush()
    async with Browser(chromium) as browser:
        await browser.send("Emulation.setDeviceMetricsOverride", width=width, height=900,
                           deviceScaleFactor=1, mobile=False)
        await browser.goto(node.api.url + "/")
        await browser.wait_for("document.querySelectorAll('#rules .scheduled').length === 4",
                               message="every rule's scheduled keys on the page")
        assert await browser.evaluate("window.innerWidth") == width
        hidden = await browser.evaluate(IN_VIEW)
        assert hidden == [], f"out of view at {width} px: {hidden}"
        overflow = await browser.evaluate(
            "(() => { const s = document.querySelector('#rules').closest('section');"
            " return s.scrollWidth - s.clientWidth; })()")
        assert overflow <= 0, f"the rules table overflows its panel by {overflow} px"
