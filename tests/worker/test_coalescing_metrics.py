"""The coalescing figures a node exports: touches per refresh, the lags from a burst's
first and last touch to its refresh, refreshes the max_wait cap forced, and reruns
caused by touches that came while a refresh ran (a writer process and a node)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest_asyncio
from prometheus_client import generate_latest

from coalescer import Coalescer
from coalescer.config.rules import Config
from coalescer.store import key_states
from tests.helpers.servers import wait_until
from tests.web.test_api import metric

HANDLERS = """\
import asyncio

calls = []
gate = asyncio.Event()  # refreshes of keys in `held` wait on it
held = set()


async def refresh(claim):
    calls.append(claim)
    if claim.key in held:
        await gate.wait()
"""

RULES = """\
namespace: {ns}
defaults:
  absorb: 1ms
rules:
  - name: burst
    match: "burst:{{id}}"
    window: 300ms
    max_wait: 30s
    handler: handlers:refresh
  - name: capped
    match: "capped:{{id}}"
    window: 2s
    max_wait: 2s
    handler: handlers:refresh
"""

Pair = tuple[Coalescer, Coalescer, Any]  # a writer, a node, the handlers module


@pytest_asyncio.fixture
async def pair(namespace: str, redis_url: str,
               rules_file: Any) -> AsyncIterator[Callable[[], Awaitable[Pair]]]:
    async with AsyncExitStack() as stack:
        async def make() -> Pair:
            config = Config.from_yaml(rules_file(RULES.format(ns=namespace), HANDLERS))
            writer = Coalescer(config, redis_url=redis_url, worker=False)
            node = Coalescer(config, redis_url=redis_url, worker=True, grace=1.0)
            await stack.enter_async_context(writer)
            await stack.enter_async_context(node)
            return writer, node, sys.modules["handlers"]

        yield make


def scrape(node: Coalescer) -> str:
    return generate_latest(node.metrics.registry).decode()


async def refreshed(node: Coalescer, rule: str, n: int) -> str:
    """The node's metrics once ``n`` refreshes of ``rule`` succeeded."""
    async def done() -> str | None:
        text = scrape(node)
        ok = metric(text, "coalescer_refreshes_total", rule=rule, outcome="success") >= n
        return text if ok else None
    text: str = await wait_until(done, timeout=10, message=f"{n} refreshes of {rule}")
    return text


async def touch(writer: Coalescer, key: str) -> None:
    """One touch written to Redis on its own."""
    writer.touch(key)
    await writer.flush()


async def test_touches_per_refresh_and_the_lags_from_first_and_last_touch(
        pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, node, _ = await pair()
    for _ in range(3):
        await touch(writer, "burst:a")
    await touch(writer, "burst:b")
    text = await refreshed(node, "burst", 2)
    assert metric(text, "coalescer_refresh_touches_count", rule="burst") == 2
    assert metric(text, "coalescer_refresh_touches_sum", rule="burst") == 4
    assert metric(text, "coalescer_refresh_touches_bucket", rule="burst", le="1") == 1
    assert metric(text, "coalescer_refresh_touches_bucket", rule="burst", le="5") == 2
    first = metric(text, "coalescer_refresh_first_touch_lag_seconds_sum", rule="burst")
    last = metric(text, "coalescer_refresh_last_touch_lag_seconds_sum", rule="burst")
    assert metric(text, "coalescer_refresh_first_touch_lag_seconds_count", rule="burst") == 2
    assert metric(text, "coalescer_refresh_last_touch_lag_seconds_count", rule="burst") == 2
    assert first > last > 0
    assert metric(text, "coalescer_refreshes_forced_by_max_wait_total", rule="burst") == 0


async def test_a_burst_the_max_wait_cap_ran_counts_as_forced(
        pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, node, _ = await pair()
    await touch(writer, "capped:once")  # due when its window ends: not forced
    await touch(writer, "capped:again")
    shard = writer.keyspace.shard(0)
    state = key_states.pending(await writer.redis.hget(shard.meta, "capped:again"))
    assert state is not None

    async def later() -> bool:
        seconds, micros = await writer.redis.time()
        return bool(seconds * 1000 + micros // 1000 > state.first_ms)
    await wait_until(later, timeout=5, message="the server clock past the first touch")
    await touch(writer, "capped:again")  # its window would end past first + max_wait
    text = await refreshed(node, "capped", 2)
    assert metric(text, "coalescer_refreshes_forced_by_max_wait_total", rule="capped") == 1
    assert metric(text, "coalescer_refresh_touches_sum", rule="capped") == 3


async def test_a_touch_while_a_refresh_runs_counts_one_rerun(
        pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, node, handlers = await pair()
    handlers.held.add("burst:slow")
    await touch(writer, "burst:slow")
    await touch(writer, "burst:quiet")
    await wait_until(lambda: any(c.key == "burst:slow" for c in handlers.calls),
                     timeout=10, message="the slow refresh to start")
    await touch(writer, "burst:slow")
    handlers.held.clear()
    handlers.gate.set()
    text = await refreshed(node, "burst", 3)
    assert metric(text, "coalescer_reruns_total", rule="burst") == 1
    assert [c.key for c in handlers.calls].count("burst:slow") == 2
