"""A pause holds once it has returned, even against a leader that has not heard of it:
the leader's link to Redis is black-holed (through the suite's fault proxy) while an
operator pauses a rule, and its claims, decided before it could hear of the pause,
reach Redis at the heal. They claim none of the paused rule's keys; a resume runs
every one of them once."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.conftest import RulesFactory, Start
from tests.helpers.e2e import leader_node
from tests.helpers.faults import FaultProxy
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
leader_lease: 6s
claim_lease: 10s
defaults:
  absorb: 5ms
  timeout: 60s
  concurrency: 64
  retry: {{attempts: 1, backoff: 10ms, max_backoff: 10ms}}
rules:
  - name: item
    match: "item:{{id}}"
    window: 1s
    max_wait: 2s
    handler: handlers:refresh
  - name: witness
    match: "witness:{{id}}"
    window: 20ms
    max_wait: 1s
    handler: handlers:refresh
"""

HANDLERS = """\
runs = []  # (key, token), in start order


async def refresh(claim):
    runs.append((claim.key, claim.token))
"""

ITEMS = [f"item:{n}" for n in range(40)]
HOLE = 2.0  # seconds the leader's link is black-holed: past the items' window


@pytest.fixture
def proxy(redis_server: ValkeyProcess) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as started:
        yield started


def item_runs() -> list[str]:
    return [key for key, _ in sys.modules["handlers"].runs if key.startswith("item:")]


def ran(key: str) -> bool:
    return any(k == key for k, _ in sys.modules["handlers"].runs)


async def touch_and_witness(writer: Coalescer, keys: list[str], witness: str) -> None:
    """Touch ``keys``, then ``witness`` (a short window), and wait for the witness's
    run: the leader's poller has claimed since the keys were scheduled, so it knows
    when they come due."""
    writer.touch_many(keys)
    await writer.flush()
    writer.touch(witness)
    await writer.flush()
    await wait_until(lambda: ran(witness), message=f"{witness} ran")


async def leads(c: Coalescer, namespace: str) -> bool:
    assert c._run.scripts is not None
    value = await c._run.scripts.client.get(KeySpace(namespace, 1).shard(0).leader)
    return leader_node(value) == "a"


async def test_a_pause_holds_against_a_leader_cut_off_when_it_was_made(
        rules_file: RulesFactory, start: Start, namespace: str, redis_url: str,
        proxy: FaultProxy) -> None:
    rules: Path = rules_file(RULES.format(ns=namespace), HANDLERS)
    a = await start(rules, redis_url=proxy.url(redis_url), node_id="a")
    await wait_until(lambda: leads(a, namespace), message="a leads the shard")
    operator = await start(rules, redis_url=redis_url, worker=False)
    await touch_and_witness(operator, ITEMS, "witness:before")

    proxy.black_hole()  # a keeps its lease; it hears nothing, and nothing it sends lands
    assert await operator.query.pause("item") is True
    await asyncio.sleep(HOLE)  # the fault's length: the items come due meanwhile
    proxy.heal()

    await wait_until(lambda: paused_seen(a), message="a read the pause")
    await touch_and_witness(operator, [], "witness:after")
    assert item_runs() == []
    assert await leads(a, namespace)  # the same leader claimed after the heal

    assert await operator.query.resume("item") is True
    await wait_until(lambda: len(item_runs()) >= len(ITEMS), timeout=20,
                     message="every item ran once resumed")
    assert sorted(item_runs()) == sorted(ITEMS)


def paused_seen(node: Coalescer) -> bool:
    sample: float | None = node.metrics.registry.get_sample_value(
        "coalescer_rule_paused", {"rule": "item"})
    return sample == 1
