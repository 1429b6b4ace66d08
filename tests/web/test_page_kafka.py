"""The status page's Sources table in a real headless Chromium: a Kafka source on a real
Kafka-protocol broker (Tansu) shows its topics, group and each partition's lag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import new_topic, produce
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]

RULES = """\
namespace: {ns}
defaults: {{window: 1h, max_wait: 1h}}
rules:
  - name: order
    match: "order:{{id}}"
    handler: builtins:repr
sources:
  - {{name: orders, type: kafka, bootstrap: "{bootstrap}", topics: [{topic}],
     group: "g-{topic}", start: earliest, key: "order:{{orderId}}"}}
"""


async def test_the_page_shows_a_kafka_sources_partitions_and_their_lag(
        chromium: str, redis_url: str, namespace: str, tmp_path: Path,
        kafka: TansuBroker) -> None:
    topic = await new_topic(kafka, partitions=2)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace, bootstrap=kafka.bootstrap, topic=topic))
    await produce(kafka, topic, [{"orderId": 1}, ["poison"]], partition=0)
    async with Coalescer.from_yaml(rules, redis_url=redis_url, grace=2.0) as c:
        api = HttpApi(c, port=0)
        await api.start()
        try:
            async def reported() -> Any:
                found = (await c.query.status())["sources"]["orders"]
                return found["rejected"] and len(found["partitions"]) == 2

            await wait_until(reported, timeout=20)
            async with Browser(chromium) as browser:
                await browser.goto(api.url + "/")
                row = json.dumps("#sources tr[data-source=orders]")
                await browser.wait_for(f"document.querySelector({row})",
                                       message="the sources table")
                cells = await browser.evaluate(
                    f"[...document.querySelector({row}).children].map(td => td.textContent)")
                assert cells[0] == "orders"
                assert cells[1] == (f"kafka {topic} (group g-{topic}): {topic}/0 lag 0 on "
                                    f"{c.node_id}; {topic}/1 lag 0 on {c.node_id}")
                assert (cells[2], cells[4]) == ("0", "1")
        finally:
            await api.close()
