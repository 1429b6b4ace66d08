"""GET /metrics of a node's HTTP API for a fair rule: one series per group that status
shows (the top ones by backlog) and one, group="(other)", for the rest, whatever the
number of tenants (the set-up of tests/query/test_fair_status.py: 13 groups)."""

from __future__ import annotations

import re
from typing import Any

import aiohttp

from coalescer.query.fair_status import OTHER, TOP
from coalescer.web.api import HttpApi
from tests.query.test_fair_status import HANDLERS, RULES, backlogged


async def test_metrics_export_the_top_groups_and_one_series_for_the_rest(
        rules_file: Any, namespace: str, redis_url: str, start: Any) -> None:
    rules = rules_file(RULES.format(ns=namespace), HANDLERS)
    c = await backlogged(rules, redis_url, start)
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(api.url + "/metrics") as resp:
            metrics = await resp.text()
    finally:
        await api.close()
    series = re.findall(r'^coalescer_fair_backlog_keys\{group="([^"]+)",rule="t"\} (\S+)$',
                        metrics, re.M)
    assert len(series) == TOP + 1  # bounded: the top groups and one for the rest
    assert dict(series)["big"] in ("19.0", "20.0")
    assert OTHER in dict(series)
    running = re.findall(r'^coalescer_fair_running\{group="[^"]+",rule="t"\} (\S+)$',
                         metrics, re.M)
    assert len(running) == TOP + 1 and all(float(v) <= 1 for v in running)
