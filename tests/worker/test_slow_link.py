"""A node whose every call to its server is slow from its start: 400 ms each way through
the suite's fault proxy, a round trip of about a third of the default leader lease.

Node ``a`` runs behind the proxy with the default leases; node ``b`` stands by on a
direct link, so any lease of ``a``'s that lapsed would be taken over and show. A writer
on a direct link touches keys for a while; the handler records each run (its key, its
token, when it started and ended, and how late it started against its due time, both
read from the server's clock: the claim's ``due_ms`` against the wall clock the server
shares with this test). The test counts what a user would: leases lost, claims stopped,
runs of a key that overlapped, touches not followed by a refresh, and refreshes that
started more than a few round trips past their due time.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from coalescer.store.keys import KeySpace
from tests.conftest import RulesFactory, Start
from tests.helpers.e2e import leader_node, settled
from tests.helpers.faults import FaultProxy
from tests.helpers.leases import renewals
from tests.helpers.servers import ValkeyProcess, wait_until

pytestmark = pytest.mark.slow

LATENCY = 0.4  # seconds, each way
LATE_ROUND_TRIPS = 4  # a refresh starts within this many round trips of its due time

RULES = """\
namespace: {ns}
defaults:
  window: 300ms
  max_wait: 2s
  absorb: 10ms
  timeout: 60s
  concurrency: 100
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

HANDLERS = """\
import asyncio
import time

runs = []  # [key, token, started (wall), ended (wall) or None, outcome, late ms]
hold = 6.0  # seconds a run takes: more than a claim lease, renewed all along


async def refresh(claim):
    now = time.time()
    run = [claim.key, claim.token, now, None, "stopped", now * 1000 - claim.due_ms]
    runs.append(run)
    try:
        await asyncio.sleep(hold)
        run[4] = "done"
    finally:
        run[3] = time.time()
"""

ROUNDS = 12  # rounds of touches, one a second, each of keys of its own (a key touched
PER_ROUND = 8  # while it runs would wait for its run to end: not what is measured here)


@pytest.fixture
def proxy(redis_server: ValkeyProcess) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as started:
        yield started


def overlaps(runs: list[list[Any]]) -> list[tuple[str, int, int]]:
    """Pairs of runs of one key from different claims that ran at the same time."""
    found = []
    for i, first in enumerate(runs):
        for later in runs[i + 1:]:
            if (first[0] == later[0] and first[1] != later[1]
                    and later[2] < (first[3] or float("inf"))):
                found.append((first[0], first[1], later[1]))
    return found


def lost(runs: list[list[Any]], last_touch: dict[str, float]) -> list[str]:
    """Keys whose last touch no finished run started after."""
    return [key for key, touched in last_touch.items()
            if not any(r[0] == key and r[4] == "done" and r[2] >= touched for r in runs)]


async def touch_rounds(start: Start, rules: Any, url: str) -> dict[str, float]:
    """Touch ``PER_ROUND`` new keys, twice, once a second for ``ROUNDS`` seconds; when
    each was last touched."""
    writer = await start(rules, redis_url=url, worker=False)
    last: dict[str, float] = {}
    for n in range(ROUNDS):
        for key in [f"item:{n}-{i % PER_ROUND}" for i in range(2 * PER_ROUND)]:
            last[key] = time.time()
            writer.touch(key)
        await writer.flush()
        await asyncio.sleep(1.0)  # the touches' cadence (what is measured is the node's)
    return last


def handlers_module() -> ModuleType:
    return sys.modules["handlers"]


async def test_a_round_trip_of_a_third_of_the_default_lease_from_the_start_keeps_every_lease(
        *, proxy: FaultProxy, rules_file: RulesFactory, start: Start, namespace: str,
        redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    rules = rules_file(RULES.format(ns=namespace), HANDLERS)
    caplog.set_level(logging.INFO)
    proxy.latency(LATENCY)  # before the node starts: its first calls are slow too
    await start(rules, redis_url=proxy.url(redis_url), node_id="a")
    leader = KeySpace(namespace, 1).shard(0).leader

    async def a_leads() -> bool:
        return leader_node(await redis_client.get(leader)) == "a"
    await wait_until(a_leads, timeout=30, message="a leads the shard")
    await start(rules, redis_url=redis_url, node_id="b")  # stands by on a direct link
    await renewals(redis_client, namespace, "a", 2)  # a has seen b
    last_touch = await touch_rounds(start, rules, redis_url)
    await wait_until(lambda: settled(redis_client, namespace), timeout=60,
                     message="every key refreshed")
    runs = handlers_module().runs
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("coalescer")]
    taken = [r.getMessage() for r in caplog.records if "forgot node" in r.getMessage()]
    round_trip_ms = 2 * LATENCY * 1000
    late = sorted(round(r[5]) for r in runs)
    assert warnings == []  # no lease of a's lapsed, no claim was stopped
    assert taken == []  # b never judged a's lease lapsed
    assert {r[4] for r in runs} == {"done"}
    assert {leader_node(await redis_client.get(leader))} == {"a"}
    assert lost(runs, last_touch) == []
    assert overlaps(runs) == []
    assert len(runs) == ROUNDS * PER_ROUND  # every key once: no claim was lost or stopped
    assert [ms for ms in late if ms > LATE_ROUND_TRIPS * round_trip_ms] == [], late
