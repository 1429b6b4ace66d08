"""An ``async def`` handler that blocks the event loop is named in one warning, once
per rule, with what to do instead; an async handler that awaits is never named."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from coalescer.worker.loop_lag import LoopLag
from tests.conftest import Start

RULES = """\
namespace: {ns}
rules:
  - name: blocking
    match: "blocking:{{id}}"
    handler: handlers:blocking
  - name: polite
    match: "polite:{{id}}"
    handler: handlers:polite
"""
HANDLERS = """\
import asyncio
import time

async def blocking(claim):
    time.sleep(0.7)  # the mistake: a blocking call inside async def

async def polite(claim):
    await asyncio.sleep(0.7)
"""
ADVICE = ("use `def` (runs in a child process) or await non-blocking calls (the node's "
          "leases and touches wait while it blocks)")


async def test_a_blocking_async_handler_is_named_once_and_an_awaiting_one_never(
        rules_file: Callable[..., Path], namespace: str, redis_url: str, start: Start,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.worker.loop_lag")
    c = await start(rules_file(RULES.format(ns=namespace), HANDLERS), redis_url=redis_url)
    c.touch_many(["blocking:1", "blocking:2", "polite:1", "polite:2"])
    claims = await c.drain(timeout=20)
    assert sorted(claim.key for claim in claims) == [
        "blocking:1", "blocking:2", "polite:1", "polite:2"]

    lines = [r.getMessage() for r in caplog.records if r.name == "coalescer.worker.loop_lag"]
    assert len(lines) == 1, lines  # two blocking runs, one line
    assert lines[0].startswith("rule 'blocking': its async handler handlers:blocking blocked "
                               "the event loop for ")
    assert lines[0].endswith(ADVICE)


async def test_a_watched_handler_returns_raises_and_is_cancelled_as_it_would_be() -> None:
    ended: list[str] = []

    async def handler(claim: object) -> object:
        try:
            await asyncio.sleep(0)
            if claim == "fail":
                raise ValueError("bad row")
            if claim == "hang":
                await asyncio.sleep(30)
            return f"done {claim}"
        finally:
            ended.append(str(claim))

    watched = LoopLag().wrap("r", "h", handler)
    assert await watched("ok") == "done ok"
    with pytest.raises(ValueError, match="bad row"):
        await watched("fail")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(watched("hang"), 0.05)
    assert ended == ["ok", "fail", "hang"]  # the cancelled run's finally ran too
