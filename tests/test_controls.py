"""An operator's controls on real nodes and a real valkey-server: pause and resume a
rule (cluster-wide, across restarts; a paused rule keeps every touch and runs none),
run keys now."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer, UnknownKeyError
from coalescer.query.explain import format_explain
from coalescer.query.status import format_status
from coalescer.store.keys import paused_rules
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.servers import Cluster, wait_until

RULES = """\
namespace: {ns}
shards: 2
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 5ms
  timeout: 5s
  retry: {{attempts: 1, backoff: 10ms, max_backoff: 10ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
  - name: other
    match: "other:{{id}}"
    handler: {{mod}}:refresh
  - name: slow
    match: "slow:{{id}}"
    window: 1h
    max_wait: 2h
    handler: {{mod}}:refresh
"""

ITEMS = [f"item:{n}" for n in range(6)]


def setup(tmp_path: Path, namespace: str) -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"controls_{namespace}", RULES.format(ns=namespace))


def paused_gauge(node: Coalescer, rule: str) -> float | None:
    """The node's coalescer_rule_paused gauge of ``rule`` (None before its first read)."""
    return node.metrics.registry.get_sample_value("coalescer_rule_paused", {"rule": rule})


def runs(rec: Recorder, keys: list[str]) -> list[int]:
    return [len(rec.of(key)) for key in keys]


async def touch_then_witness(node: Coalescer, rec: Recorder, keys: list[str],
                             witness: str) -> None:
    """Touch ``keys``, then ``witness`` (same window, a rule not paused), and wait for
    the witness's refresh: the keys were due before it, so a node that would run them
    has claimed them by then."""
    node.touch_many(keys)
    await node.flush()
    node.touch(witness)
    await node.flush()
    await wait_until(lambda: rec.of(witness), message=f"{witness} refreshed")


async def test_a_paused_rule_keeps_its_touches_and_runs_each_key_once_resumed(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    node = await start(path, redis_url=redis_url, node_id="n1")
    operator = await start(path, redis_url=redis_url, worker=False)
    assert await operator.query.pause("item") is True
    await wait_until(lambda: paused_gauge(node, "item") == 1,
                     message="the node heard of the pause")
    await touch_then_witness(node, rec, ITEMS, "other:1")
    await touch_then_witness(node, rec, ITEMS[:3], "other:2")  # touched again while paused
    assert runs(rec, ITEMS) == [0] * len(ITEMS)

    status = await operator.query.status()
    assert status["rules"]["item"]["paused"] is True
    assert status["rules"]["other"]["paused"] is False
    assert status["rules"]["item"]["pending"] == len(ITEMS)
    item_row = next(line for line in format_status(status, 0).splitlines()
                    if line.startswith("item "))
    assert "paused" in item_row
    info = await operator.query.explain("item:1")
    assert info["state"] == "pending" and info["rule_paused"] is True
    assert "pending, but its rule is paused" in format_explain(info)

    assert await operator.query.resume("item") is True
    await wait_until(lambda: all(runs(rec, ITEMS)), message="every paused key refreshed")
    node.touch("other:3")
    await node.flush()
    await wait_until(lambda: rec.of("other:3"))
    assert runs(rec, ITEMS) == [1] * len(ITEMS)
    assert (await operator.query.explain("item:1"))["rule_paused"] is False


async def test_a_pause_outlives_the_node_and_binds_the_next_one(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    first = Coalescer.from_yaml(path, redis_url=redis_url, node_id="n1", grace=1.0)
    async with first:
        await first.query.pause("item")
        await wait_until(lambda: paused_gauge(first, "item") == 1)
        first.touch_many(ITEMS)
        await first.flush()
    second = await start(path, redis_url=redis_url, node_id="n2")
    await touch_then_witness(second, rec, [], "other:1")
    assert runs(rec, ITEMS) == [0] * len(ITEMS)
    assert await second.query.paused() == ["item"]
    await second.query.resume("item")
    await wait_until(lambda: all(runs(rec, ITEMS)), message="every paused key refreshed")
    assert runs(rec, ITEMS) == [1] * len(ITEMS)


async def test_pause_and_resume_say_whether_they_changed_anything(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    assert await c.query.pause("item") is True
    assert await c.query.pause("item") is False
    assert await c.query.resume("item") is True
    assert await c.query.resume("item") is False
    with pytest.raises(KeyError, match="no rule named 'nope'"):
        await c.query.pause("nope")
    with pytest.raises(KeyError, match="no rule named 'nope'"):
        await c.query.resume("nope")
    assert await c.query.paused() == []


async def test_a_paused_rule_these_rules_lack_can_still_be_resumed(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    await c.query.pause("item")
    older = tmp_path / "older.yaml"  # a rules file without the rule (a rolling deploy)
    older.write_text(path.read_text().replace('  - name: item\n    match: "item:{id}"\n',
                                              '  - name: gone\n    match: "gone:{id}"\n'))
    other = await start(older, redis_url=redis_url, worker=False)
    assert "item" not in {r.name for r in other.config.rules}
    assert await other.query.resume("item") is True
    assert await c.query.paused() == []


async def test_run_now_runs_a_key_whose_window_has_long_to_go(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    node = await start(path, redis_url=redis_url, node_id="n1")
    node.touch_many(["slow:1", "slow:2"])
    await node.flush()
    outcome = await node.query.run_now(["slow:1", "slow:3"])
    assert outcome.run == ["slow:1"]
    assert outcome.not_pending == ["slow:3"] and outcome.states["slow:3"] == "idle"
    await wait_until(lambda: rec.of("slow:1"), message="slow:1 refreshed")
    assert rec.of("slow:2") == []
    assert (await node.query.explain("slow:2"))["state"] == "pending"


async def test_run_now_names_running_and_dead_keys_and_refuses_unknown_ones(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    node = await start(path, redis_url=redis_url, node_id="n1")
    release = asyncio.Event()

    async def hold(claim: object) -> None:
        if getattr(claim, "key", "") == "other:run":
            await release.wait()
        else:
            raise RuntimeError("refused")
    rec.hook = hold  # type: ignore[assignment]
    node.touch_many(["other:run", "other:dead"])
    await node.flush()
    await wait_until(lambda: rec.of("other:run"))

    async def dead() -> bool:
        return (await node.query.explain("other:dead"))["state"] == "dead"
    await wait_until(dead, message="other:dead dead-lettered")
    outcome = await node.query.run_now(["other:run", "other:dead"])
    release.set()
    assert outcome.run == []
    assert outcome.states == {"other:run": "running", "other:dead": "dead"}
    with pytest.raises(UnknownKeyError):
        await node.query.run_now(["slow:1", "nomatch:1"])
    assert (await node.query.explain("slow:1"))["state"] == "idle"


async def test_run_now_of_a_paused_rule_waits_for_the_resume(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    node = await start(path, redis_url=redis_url, node_id="n1")
    await node.query.pause("slow")
    node.touch("slow:1")
    await node.flush()
    assert (await node.query.run_now(["slow:1"])).run == ["slow:1"]
    await touch_then_witness(node, rec, [], "other:1")
    assert rec.of("slow:1") == []
    await node.query.resume("slow")
    await wait_until(lambda: rec.of("slow:1"), message="slow:1 refreshed once resumed")


async def test_a_pause_holds_on_a_redis_cluster(tmp_path: Path, namespace: str,
                                                cluster: Cluster, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    node = await start(path, redis_url=cluster.url, node_id="n1")
    await node.query.pause("item")
    await wait_until(lambda: paused_gauge(node, "item") == 1, timeout=20,
                     message="the node heard of the pause")
    await touch_then_witness(node, rec, ITEMS, "other:1")
    assert runs(rec, ITEMS) == [0] * len(ITEMS)
    await node.query.resume("item")
    await wait_until(lambda: all(runs(rec, ITEMS)), timeout=20,
                     message="every paused key refreshed")
    assert runs(rec, ITEMS) == [1] * len(ITEMS)


async def test_a_drain_runs_the_keys_of_a_paused_rule(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    await c.query.pause("slow")
    c.touch_many(["slow:1", "slow:2"])
    ran = await c.drain(timeout=10)
    assert sorted(claim.key for claim in ran) == ["slow:1", "slow:2"]
    assert runs(rec, ["slow:1", "slow:2"]) == [1, 1]
    assert await c.query.paused() == ["slow"]  # the drain leaves the pause as it was


async def test_a_node_that_cannot_read_the_paused_rules_runs_nothing_until_it_can(
        tmp_path: Path, namespace: str, redis_url: str, start: Start, *,
        redis_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.worker.paused")
    path, rec = setup(tmp_path, namespace)
    key = paused_rules(namespace)
    await redis_client.set(key, "not a set")  # every read answers WRONGTYPE
    node = await start(path, redis_url=redis_url, node_id="n1")
    node.touch("other:1")
    await node.flush()

    def failed_reads() -> int:
        return sum("reading the paused rules failed" in r.getMessage() for r in caplog.records)

    async def due() -> bool:
        found = await node.query.next_due()
        return any(k["key"] == "other:1" and k["due_ms"] <= found["now_ms"]
                   for k in found["rules"]["other"])

    await wait_until(due, message="other:1 due")
    await wait_until(lambda: failed_reads() >= 2, message="a read failed, and again")
    assert rec.of("other:1") == []
    await redis_client.delete(key)
    await wait_until(lambda: rec.of("other:1"), message="other:1 refreshed once read")
