"""Leadership follows health: a node whose refreshes fail as a whole hands its shards to a
healthy node; a few bad keys never move a shard; a lone failing node keeps leading.

The failing leader of the first test is a real `coalescer run` process whose handler
fails on an environment variable (a leaking process), its standby an in-process node.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from coalescer.worker.failure_window import FailureWindow
from tests.conftest import RulesFactory, Start
from tests.helpers.e2e import NodeProcs, leader_node
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
claim_lease: 1s
defaults:
  window: 20ms
  absorb: 5ms
  retry: {{attempts: {attempts}, backoff: 100ms, max_backoff: 300ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
"""

# Fails every run while the file HEALTH_BROKEN names exists (the whole process is broken),
# and every run of a key named item:bad-N wherever it runs (the key is broken). Keys
# refreshed go to ``done`` (in-process nodes) and to the file HEALTH_LOG names, if any.
HANDLERS = """\
import os

done = []


async def refresh(claim):
    broken = os.environ.get("HEALTH_BROKEN", "")
    if (broken and os.path.exists(broken)) or claim.key.startswith("item:bad-"):
        raise MemoryError("cannot allocate: the handler leaks")
    done.append(claim.key)
    if os.environ.get("HEALTH_LOG"):
        with open(os.environ["HEALTH_LOG"], "a") as f:
            f.write(claim.key + "\\n")
"""


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeProcs]:
    procs = NodeProcs(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """The file whose presence breaks the handlers of a node given it as HEALTH_BROKEN."""
    path = tmp_path / "broken"
    path.touch()
    return path


def sample(c: Coalescer, name: str) -> float | None:
    return c.metrics.registry.get_sample_value(name)


async def leader(r: Any, namespace: str) -> str | None:
    return leader_node(await r.get(KeySpace(namespace, 1).shard(0).leader))


async def dead(r: Any, namespace: str) -> int:
    return int(await r.zcard(KeySpace(namespace, 1).shard(0).dead("item")))


def done() -> list[str]:
    handlers: Any = sys.modules["handlers"]
    return list(handlers.done)


async def test_a_leader_whose_every_run_fails_hands_its_shard_to_a_healthy_standby(
        rules_file: RulesFactory, start: Start, nodes: NodeProcs, broken: Path, *, redis_url: str,
        redis_client: Any, namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=1, attempts=10), HANDLERS)
    nodes.start(rules, redis_url, "a", HEALTH_BROKEN=str(broken))
    await wait_until(lambda: leader(redis_client, namespace), timeout=20,
                     message=f"node a leading; its log:\n{nodes.log('a')}")
    b = await start(rules, redis_url=redis_url, node_id="b")
    await wait_until(lambda: redis_client.zscore(KeySpace(namespace, 1).shard(0).nodes, "b"),
                     message="node b standing by")
    assert await leader(redis_client, namespace) == "a"
    keys = [f"item:{i}" for i in range(20)]
    b.touch_many(keys)
    await b.flush()
    await wait_until(lambda: set(done()) == set(keys), timeout=30,
                     message=f"every key refreshed by b; a's log:\n{nodes.log('a')}")
    assert await leader(redis_client, namespace) == "b"
    assert b.leads() == [0]
    gave_up = [line for line in nodes.log("a").splitlines() if "gave up the 1 shard" in line]
    assert len(gave_up) == 1, nodes.log("a")
    assert "refreshes failed (" in gave_up[0] and "distinct keys" in gave_up[0]
    assert await dead(redis_client, namespace) == 0
    assert sample(b, "coalescer_node_unhealthy") == 0


async def test_the_healthy_node_keeps_every_shard_the_failing_one_gave_up_during_its_cool_off(
        rules_file: RulesFactory, start: Start, nodes: NodeProcs, broken: Path, *, redis_url: str,
        redis_client: Any, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="coalescer.worker.leadership")
    caplog.set_level(logging.INFO, logger="coalescer.worker.lead_log")
    rules = rules_file(RULES.format(ns=namespace, shards=4, attempts=10), HANDLERS)
    space = KeySpace(namespace, 4)

    async def leaders() -> list[str | None]:
        return [leader_node(await redis_client.get(s.leader)) for s in space.all_shards()]

    nodes.start(rules, redis_url, "a", HEALTH_BROKEN=str(broken))
    await wait_until(lambda: _led_by(leaders, ["a"] * 4), timeout=20,
                     message=f"node a leading every shard; its log:\n{nodes.log('a')}")
    b = await start(rules, redis_url=redis_url, node_id="b")
    await wait_until(lambda: len(b.leads()) == 2, timeout=20, message="b leading its share")
    keys = [f"item:{i}" for i in range(40)]
    b.touch_many(keys)
    await b.flush()
    await wait_until(lambda: set(done()) == set(keys), timeout=30,
                     message=f"every key refreshed by b; a's log:\n{nodes.log('a')}")
    assert "gave up the 2 shards" in nodes.log("a")
    # b's line comes once it led all four for two of its rebalancing rounds: it handed none
    # back to the node cooling off (which would leave them without a leader meanwhile)
    summary = "b leads 4 of 4 shards"
    await wait_until(lambda: any(summary in r.getMessage() for r in caplog.records),
                     timeout=10, message="b's leadership line")
    lines = [r.getMessage() for r in caplog.records]
    before = lines[:next(i for i, line in enumerate(lines) if summary in line)]
    assert not [line for line in before if "handing back" in line]
    assert await leaders() == ["b"] * 4


async def test_a_node_fixed_during_its_cool_off_leads_again_once_it_ends(
        rules_file: RulesFactory, start: Start, nodes: NodeProcs, broken: Path, *,
        tmp_path: Path, redis_url: str, redis_client: Any, namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=2, attempts=10), HANDLERS)
    space = KeySpace(namespace, 2)
    a_log = tmp_path / "a-refreshed.log"

    async def leaders() -> list[str | None]:
        return [leader_node(await redis_client.get(s.leader)) for s in space.all_shards()]

    nodes.start(rules, redis_url, "a", HEALTH_BROKEN=str(broken), HEALTH_LOG=str(a_log))
    await wait_until(lambda: _led_by(leaders, ["a", "a"]), timeout=20,
                     message=f"node a leading every shard; its log:\n{nodes.log('a')}")
    b = await start(rules, redis_url=redis_url, node_id="b")
    await wait_until(lambda: len(b.leads()) == 1, timeout=20, message="b leading its share")
    first = [f"item:{i}" for i in range(40)]
    b.touch_many(first)
    await b.flush()
    await wait_until(lambda: set(done()) == set(first), timeout=30,
                     message=f"every key refreshed by b; a's log:\n{nodes.log('a')}")
    assert "gave up the 1 shard" in nodes.log("a")
    assert not a_log.exists()
    broken.unlink()  # a is fixed (say, restarted its leaking pool) while it cools off
    await wait_until(lambda: "its cool-off ended; it asks for shards again" in nodes.log("a"),
                     timeout=20, message=f"a's cool-off to end; its log:\n{nodes.log('a')}")
    await wait_until(lambda: _led_by(leaders, ["a", "b"], ["b", "a"]), timeout=20,
                     message=f"a leading a shard again; its log:\n{nodes.log('a')}")
    later = [f"item:{i}" for i in range(100, 140)]
    b.touch_many(later)
    await b.flush()

    def refreshed() -> set[str]:
        by_a = a_log.read_text().split() if a_log.exists() else []
        return set(done()) | set(by_a)

    await wait_until(lambda: set(later) <= refreshed(), timeout=30,
                     message="every later key refreshed")
    assert set(a_log.read_text().split()) & set(later)  # a refreshes its shard's keys again
    assert nodes.log("a").count("gave up") == 1


async def _led_by(leaders: Any, *expected: list[str]) -> bool:
    return bool(await leaders() in expected)


async def test_a_few_bad_keys_failing_every_time_never_move_the_shard(
        rules_file: RulesFactory, start: Start, redis_url: str, redis_client: Any,
        namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=1, attempts=5), HANDLERS)
    a = await start(rules, redis_url=redis_url, node_id="a")
    await wait_until(lambda: a.leads() == [0], message="node a leading")
    b = await start(rules, redis_url=redis_url, node_id="b")
    await wait_until(lambda: redis_client.zscore(KeySpace(namespace, 1).shard(0).nodes, "b"),
                     message="node b standing by")
    bad = [f"item:bad-{i}" for i in range(4)]  # 4 keys, 5 attempts: 20 failed runs
    a.touch_many(bad)
    await a.flush()
    await wait_until(lambda: _all_dead(redis_client, namespace, len(bad)), timeout=30,
                     message="every bad key dead-lettered")
    assert a.leads() == [0]
    assert b.leads() == []
    assert await leader(redis_client, namespace) == "a"
    assert sample(a, "coalescer_node_unhealthy") == 0
    assert sample(a, "coalescer_shards_given_up_total") == 0
    assert a.metrics.rule("item").outcomes["failure"] == 20


async def _all_dead(r: Any, namespace: str, n: int) -> bool:
    return await dead(r, namespace) == n


async def test_of_two_nodes_whose_every_run_fails_the_second_keeps_leading(
        rules_file: RulesFactory, start: Start, nodes: NodeProcs, broken: Path, *,
        redis_url: str, redis_client: Any, namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=1, attempts=10), HANDLERS)
    nodes.start(rules, redis_url, "a", HEALTH_BROKEN=str(broken))
    await wait_until(lambda: leader(redis_client, namespace), timeout=20,
                     message=f"node a leading; its log:\n{nodes.log('a')}")
    nodes.start(rules, redis_url, "b", HEALTH_BROKEN=str(broken))
    await wait_until(lambda: redis_client.zscore(KeySpace(namespace, 1).shard(0).nodes, "b"),
                     timeout=20, message=f"node b standing by; its log:\n{nodes.log('b')}")
    toucher = await start(rules, redis_url=redis_url, worker=False)
    toucher.touch_many([f"item:{i}" for i in range(20)])
    await toucher.flush()
    kept = "keeps leading its shards: every other live node gave its shards up too"
    await wait_until(lambda: kept in nodes.log("b"), timeout=30,
                     message=f"b keeping the shard; a's log:\n{nodes.log('a')}\n"
                             f"b's log:\n{nodes.log('b')}")
    assert "gave up the 1 shard" in nodes.log("a")
    assert "gave up" not in nodes.log("b")
    assert await leader(redis_client, namespace) == "b"


async def test_a_lone_node_whose_every_run_fails_keeps_leading(
        rules_file: RulesFactory, start: Start, broken: Path, *, redis_url: str,
        redis_client: Any, namespace: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
        ) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.worker.health")
    monkeypatch.setenv("HEALTH_BROKEN", str(broken))
    rules = rules_file(RULES.format(ns=namespace, shards=1, attempts=2), HANDLERS)
    a = await start(rules, redis_url=redis_url, node_id="a")
    await wait_until(lambda: a.leads() == [0], message="node a leading")
    keys = [f"item:{i}" for i in range(20)]
    a.touch_many(keys)
    await a.flush()
    await wait_until(lambda: _all_dead(redis_client, namespace, len(keys)), timeout=30,
                     message="every key dead-lettered (run on a, twice)")
    kept = [r.getMessage() for r in caplog.records if "keeps leading" in r.getMessage()]
    assert len(kept) == 1, kept
    assert "no other live node to hand them to" in kept[0]
    assert a.leads() == [0]
    assert sample(a, "coalescer_node_unhealthy") == 1
    assert sample(a, "coalescer_shards_given_up_total") == 0
    assert done() == []


def test_the_window_judges_distinct_keys_and_the_share_of_failures() -> None:
    now = [0.0]
    window = FailureWindow(clock=lambda: now[0])
    for _ in range(100):
        window.record("one-bad-key", failed=True)
    assert window.verdict() is None  # one key, 100% failed: not the node's fault
    for i in range(5):
        window.record(f"key-{i}", failed=True)
    verdict = window.verdict()
    assert verdict is not None and verdict.keys == 6 and verdict.failed == 100
    for i in range(11):  # 89 of the last 100 failed
        window.record(f"ok-{i}", failed=False)
    assert window.verdict() is None
    now[0] = 61.0  # every run aged out
    assert window.verdict() is None and len(window) == 0
