"""The status page's Fair groups table in a real headless Chromium: a fair rule's top
groups by backlog with their share, weight and runs in flight, and one row summing the
rest (the set-up of tests/query/test_fair_status.py: 13 groups, a node holding claims)."""

from __future__ import annotations

import json
from typing import Any

from coalescer.query.fair_status import OTHER, TOP
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.query.test_fair_status import HANDLERS, KEYS, RULES, backlogged
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]


def cells(group: str) -> str:
    return (f"[...document.querySelector({json.dumps(f'#fair tr[data-group={json.dumps(group)}]')})"
            ".children].map(td => td.textContent)")


async def test_the_page_lists_a_fair_rules_top_groups_and_sums_the_rest(
        chromium: str, rules_file: Any, namespace: str, redis_url: str, start: Any) -> None:
    rules = rules_file(RULES.format(ns=namespace), HANDLERS)
    c = await backlogged(rules, redis_url, start)
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with Browser(chromium) as browser:
            await browser.goto(api.url + "/")
            await browser.wait_for("document.querySelector('#fair tr[data-group]')",
                                   message="the fair groups table")
            assert await browser.evaluate(
                "document.querySelector('#fair-section').hidden") is False
            groups = await browser.evaluate(
                "[...document.querySelectorAll('#fair tr[data-group]')]"
                ".map(tr => tr.dataset.group)")
            assert len(groups) == TOP + 1 and groups[0] == "big" and groups[-1] == OTHER
            big = await browser.evaluate(cells("big"))
            assert big[0] == "t (by {org})" and big[1] == "big"
            assert int(big[2]) in (19, 20) and big[4] == "3"
            assert big[3].endswith("%") and big[5] in ("0 of 1", "1 of 1")
            other = await browser.evaluate(cells(OTHER))
            assert other[1] == f"{OTHER} (3 groups)"
            backlogs = await browser.evaluate(
                "[...document.querySelectorAll('#fair td.backlog')].map(td => +td.textContent)")
            running = await browser.evaluate(
                "[...document.querySelectorAll('#fair td.running')]"
                ".map(td => +td.textContent.split(' ')[0])")
            assert sum(backlogs) + sum(running) == len(KEYS)
    finally:
        await api.close()
