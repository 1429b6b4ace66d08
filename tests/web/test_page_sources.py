"""The status page's Sources table in a real headless Chromium: an outbox source on a
real SQLite file (a rejected row, the backlog, an error) and a stream source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.helpers.outbox import new_outbox
from tests.helpers.servers import wait_until
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]

RULES = """\
namespace: {ns}
defaults: {{window: 1h, max_wait: 1h}}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: builtins:repr
sources:
  - {{name: orders, type: outbox, url: "{url}", table: {table}, poll: 50ms}}
  - {{name: gone, type: outbox, url: "sqlite:///missing.db", poll: 50ms}}
  - {{name: events, stream: "{ns}-events", key: "stats:customer:{{id}}"}}
"""


def cells(row: str) -> str:
    return (f"[...document.querySelector({json.dumps(f'#sources tr[data-source={row}]')})"
            ".children].map(td => td.textContent)")


async def test_the_page_lists_each_source_with_its_lag_backlog_and_errors(
        chromium: str, redis_url: str, namespace: str, tmp_path: Path) -> None:
    outbox = new_outbox("sqlite", tmp_path, None)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace, url=outbox.url, table=outbox.table.name))
    outbox.write(["stats:customer:1", "orders:<b>bold</b>"])  # the second is rejected
    async with Coalescer.from_yaml(rules, redis_url=redis_url, grace=2.0) as c:
        api = HttpApi(c, port=0)
        await api.start()
        try:
            await wait_until(lambda: outbox.rows() == 0, timeout=20)

            async def reported() -> Any:
                sources = (await c.query.status())["sources"]
                return sources["gone"]["errors"] and sources["orders"]["nodes"]
            await wait_until(reported, timeout=20)
            async with Browser(chromium) as browser:
                await browser.goto(api.url + "/")
                await browser.wait_for("document.querySelector('#sources tr[data-source]')",
                                       message="the sources table")
                assert await browser.evaluate(
                    "document.querySelector('#sources-section').hidden") is False
                orders = await browser.evaluate(cells("orders"))
                assert orders == ["orders", f"outbox {outbox.table.name} at {outbox.url}",
                                  "0.0 s", "0", "1", ""]
                gone = await browser.evaluate(cells("gone"))
                assert gone[:2] == ["gone", "outbox coalescer_outbox at sqlite:///missing.db"]
                assert f"{c.node_id}: FileNotFoundError: no SQLite database at" in gone[5]
                events = await browser.evaluate(cells("events"))
                assert events[:2] == [
                    "events", f"stream {namespace}-events (group coalescer.{namespace}.events)"]
                assert await browser.evaluate("document.querySelectorAll('#sources b').length") == 0
        finally:
            await api.close()
