"""Exclusion and progress under gray failures, through real faults: a TCP fault proxy
between a node and a real server (a black hole, latency), and a real server whose
wall clock is stepped (libfaketime).

Two nodes run in this process: ``a`` leads the shard (started first), ``b`` stands
by. The handler records every run of a key (its token, when it started and ended) in
the handler module, so the tests count what a user would: runs of a key that
overlapped (two claims' runs at once), and keys never refreshed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.conftest import RulesFactory, Start
from tests.helpers.e2e import leader_node, settled
from tests.helpers.faults import FaultProxy, SteppedClockServer
from tests.helpers.leases import renewals
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
leader_lease: {leader_lease}
claim_lease: {claim_lease}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 60s
  concurrency: 32
  retry: {{attempts: 5, backoff: 50ms, max_backoff: 200ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

HANDLERS = """\
import asyncio
import time

runs = []  # [key, token, started, ended or None, outcome], in start order
release = asyncio.Event()
hold = 0.0  # seconds a run takes once released (0: ends when released)


async def refresh(claim):
    run = [claim.key, claim.token, time.monotonic(), None, "stopped"]
    runs.append(run)
    try:
        await release.wait()
        await asyncio.sleep(hold)
        run[4] = "done"
    finally:
        run[3] = time.monotonic()
"""

KEYS = [f"item:{i}" for i in range(20)]


def overlaps(runs: list[list[Any]]) -> list[tuple[str, int, int]]:
    """Pairs of runs of one key from different claims that ran at the same time."""
    found = []
    by_key: dict[str, list[list[Any]]] = {}
    for run in runs:
        by_key.setdefault(run[0], []).append(run)
    for key, mine in by_key.items():
        for i, first in enumerate(mine):
            for later in mine[i + 1:]:
                if first[1] != later[1] and later[2] < (first[3] or float("inf")):
                    found.append((key, first[1], later[1]))
    return found


@pytest.fixture
def proxy(redis_server: ValkeyProcess) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as started:
        yield started


@dataclass
class Nodes:
    """One test's rules factory, node starter and namespace."""

    rules_file: RulesFactory
    start: Start
    namespace: str

    def rules(self, leader_lease: str, claim_lease: str) -> Path:
        return self.rules_file(RULES.format(ns=self.namespace, leader_lease=leader_lease,
                                            claim_lease=claim_lease), HANDLERS)


@pytest.fixture
def nodes(rules_file: RulesFactory, start: Start, namespace: str) -> Nodes:
    return Nodes(rules_file, start, namespace)


def handlers_module() -> ModuleType:
    return sys.modules["handlers"]


async def two_nodes(start: Start, rules: Path, a_url: str, b_url: str,
                    namespace: str) -> tuple[Coalescer, Coalescer]:
    """Node ``a`` (leading the shard) on ``a_url``, then ``b`` standing by on ``b_url``."""
    a = await start(rules, redis_url=a_url, node_id="a")
    assert a._run.conn is not None
    leader = KeySpace(namespace, 1).shard(0).leader
    await wait_until(lambda: leaders(a, leader, "a"), message="a leads the shard")
    b = await start(rules, redis_url=b_url, node_id="b")
    return a, b


async def leaders(c: Coalescer, leader_key: str, node: str) -> bool:
    assert c._run.scripts is not None
    return leader_node(await c._run.scripts.client.get(leader_key)) == node


async def touch_all(start: Start, rules: Path, url: str) -> None:
    writer = await start(rules, redis_url=url, worker=False)
    for key in KEYS:
        writer.touch(key)
    await writer.flush()


def started(handlers: ModuleType, n: int) -> bool:
    return len(handlers.runs) >= n


async def test_a_black_holed_leader_stops_its_runs_before_the_standby_runs_them(
        nodes: Nodes, redis_url: str, redis_client: Any, proxy: FaultProxy) -> None:
    start, namespace = nodes.start, nodes.namespace
    rules = nodes.rules(leader_lease="1s", claim_lease="2s")
    await two_nodes(start, rules, proxy.url(redis_url), redis_url, namespace)
    handlers = handlers_module()
    await touch_all(start, rules, redis_url)
    await wait_until(lambda: started(handlers, len(KEYS)), message="a runs every key")

    proxy.black_hole()  # a's connections stay up; nothing it sends is answered
    await wait_until(lambda: started(handlers, 2 * len(KEYS)), timeout=20,
                     message="b runs every key again")
    assert overlaps(handlers.runs) == []
    handlers.release.set()
    await wait_until(lambda: settled(redis_client, namespace), timeout=20,
                     message="every key refreshed")
    proxy.heal()
    assert sorted(r[0] for r in handlers.runs if r[4] == "done") == sorted(KEYS)
    assert overlaps(handlers.runs) == []


async def test_a_round_trip_of_a_third_of_the_lease_keeps_every_lease(
        nodes: Nodes, redis_url: str, redis_client: Any, proxy: FaultProxy,
        caplog: pytest.LogCaptureFixture) -> None:
    start, namespace = nodes.start, nodes.namespace
    rules = nodes.rules(leader_lease="1.5s", claim_lease="1.5s")
    await two_nodes(start, rules, proxy.url(redis_url), redis_url, namespace)
    handlers = handlers_module()
    handlers.hold = 3.0  # two leases: every claim is renewed while its round trips are slow
    proxy.latency(0.25)  # each way: a round trip of a third of either lease
    # a's next renewal learns the round trip (one sent just before the jump may lapse)
    await renewals(redis_client, namespace, "a", 2)
    caplog.clear()
    caplog.set_level(logging.WARNING)
    await touch_all(start, rules, redis_url)
    await wait_until(lambda: started(handlers, len(KEYS)), message="a runs every key")
    handlers.release.set()
    await wait_until(lambda: settled(redis_client, namespace), timeout=30,
                     message="every key refreshed")
    # once each, by the leader, which never lost its lease or a claim
    assert sorted(r[0] for r in handlers.runs) == sorted(KEYS)
    assert all(r[4] == "done" for r in handlers.runs)
    lapses = [r.getMessage() for r in caplog.records
              if "could not renew" in r.getMessage() or "lapsed" in r.getMessage()]
    assert lapses == []


@pytest.fixture
def stepped_server(tmp_path: Path) -> Iterator[SteppedClockServer]:
    if not SteppedClockServer.available():
        pytest.skip("libfaketime is not installed (Debian's faketime package)")
    server = SteppedClockServer(tmp_path / "stepped")
    yield server
    server.stop()


@pytest.mark.parametrize("step", [10.0, 600.0])
async def test_a_forward_step_of_the_servers_clock_expires_no_live_claim(
        nodes: Nodes, stepped_server: SteppedClockServer, step: float,
        caplog: pytest.LogCaptureFixture) -> None:
    start, namespace, url = nodes.start, nodes.namespace, stepped_server.url
    rules = nodes.rules(leader_lease="1s", claim_lease="2s")
    a, _ = await two_nodes(start, rules, url, url, namespace)
    handlers = handlers_module()
    await touch_all(start, rules, url)
    await wait_until(lambda: started(handlers, len(KEYS)), message="a runs every key")
    caplog.set_level(logging.WARNING)

    stepped_server.step(step)
    # two claim leases, as this process measures time, with every claim held through them
    await asyncio.sleep(0)
    until = time.monotonic() + 4.0
    await wait_until(lambda: time.monotonic() > until or started(handlers, len(KEYS) + 1),
                     timeout=10, message="two claim leases pass")
    assert len(handlers.runs) == len(KEYS)  # no claim was taken from its live holder
    leader = KeySpace(namespace, 1).shard(0).leader
    assert await leaders(a, leader, "a")  # nor the shard from its live leader
    handlers.release.set()
    client = stepped_server.client()
    await wait_until(lambda: not any(client.hlen(k.meta)
                                     for k in KeySpace(namespace, 1).all_shards()),
                     timeout=20, message="every key refreshed")
    assert sorted(r[0] for r in handlers.runs if r[4] == "done") == sorted(KEYS)
    assert not [r for r in caplog.records if "re-queued" in r.getMessage()]
    assert [r for r in caplog.records if "clock stepped" in r.getMessage()]


async def test_a_backward_step_of_the_servers_clock_strands_no_claim_of_a_dead_holder(
        nodes: Nodes, stepped_server: SteppedClockServer) -> None:
    start = nodes.start
    with FaultProxy(stepped_server.port) as hole:
        rules = nodes.rules(leader_lease="1s", claim_lease="2s")
        await two_nodes(start, rules, hole.url(stepped_server.url), stepped_server.url,
                        nodes.namespace)
        handlers = handlers_module()
        await touch_all(start, rules, stepped_server.url)
        await wait_until(lambda: started(handlers, len(KEYS)), message="a runs every key")
        hole.black_hole()  # a is gone as far as Redis and b can tell
        stepped_server.step(-120.0)  # its claims' leases now end two minutes later
        await wait_until(lambda: started(handlers, 2 * len(KEYS)), timeout=20,
                         message="b runs every key of the silent holder")
        assert overlaps(handlers.runs) == []
        handlers.release.set()
        hole.heal()


CHILD_RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 60s
  concurrency: 8
  retry: {{attempts: 5, backoff: 50ms, max_backoff: 200ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

CHILD_HANDLERS = """\
import pathlib
import time

HERE = pathlib.Path(__file__).parent


def refresh(claim):
    # a plain function (by default in a child process): alive every 20 ms until released
    with open(HERE / "runs.log", "a") as log:
        while not (HERE / "release").exists():
            log.write(f"{claim.key} {claim.token} {time.monotonic()}\\n")
            log.flush()
            time.sleep(0.02)
"""


def child_runs(folder: Path) -> dict[tuple[str, int], tuple[float, float]]:
    """(key, token) -> (first and last time the run said it was alive)."""
    runs: dict[tuple[str, int], tuple[float, float]] = {}
    path = folder / "runs.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) != 3:
            continue  # a line a killed child left half-written
        key, token, at = parts[0], int(parts[1]), float(parts[2])
        first, _ = runs.get((key, token), (at, at))
        runs[key, token] = (first, at)
    return runs


async def test_a_black_holed_leader_kills_its_sync_runs_by_default_before_the_standby_runs_them(
        nodes: Nodes, redis_url: str, redis_client: Any, proxy: FaultProxy) -> None:
    keys = KEYS[:6]
    rules = nodes.rules_file(CHILD_RULES.format(ns=nodes.namespace), CHILD_HANDLERS)
    await two_nodes(nodes.start, rules, proxy.url(redis_url), redis_url, nodes.namespace)
    writer = await nodes.start(rules, redis_url=redis_url, worker=False)
    for key in keys:
        writer.touch(key)
    await writer.flush()
    folder = rules.parent
    await wait_until(lambda: len(child_runs(folder)) == len(keys), timeout=20,
                     message="a runs every key in a child process")

    proxy.black_hole()
    await wait_until(lambda: len(child_runs(folder)) == 2 * len(keys), timeout=20,
                     message="b runs every key again")
    runs = child_runs(folder)
    for key in keys:
        (_, first_end), (second_start, _) = sorted(
            span for (k, _), span in runs.items() if k == key)
        assert first_end < second_start, f"{key}: a's run was alive after b's began"
    (folder / "release").write_text("")
    await wait_until(lambda: settled(redis_client, nodes.namespace), timeout=20,
                     message="every key refreshed")
    proxy.heal()
