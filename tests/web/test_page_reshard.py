"""The status page in a real headless Chromium says when a reshard runs, and how far
it got."""

from __future__ import annotations

from pathlib import Path

from coalescer import Coalescer
from coalescer.web.api import HttpApi
from tests.helpers.browser import Browser
from tests.web.test_page import chromium  # the session fixture: skipped where absent

__all__ = ["chromium"]

RULES = """\
namespace: {ns}
shards: 2
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:repr
"""


async def test_the_page_shows_a_reshard_in_progress(
        chromium: str, redis_url: str, namespace: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace))
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        layouts = c._run.layouts
        assert layouts is not None and await layouts.begin(8, "test")  # no mover runs
        api = HttpApi(c, port=0)
        await api.start()
        try:
            async with Browser(chromium) as browser:
                await browser.goto(api.url + "/")
                note = await browser.wait_for(
                    "document.querySelector('#shards-note').textContent",
                    message="the shards note")
                assert note.startswith("8 shards")
                assert "resharding from 2 to 8 shards: 0 of 2 old shards drained" in note
        finally:
            await api.close()
