"""``edge: leading`` with what else a rule has: a batch handler under a rate, and
run-now of a key whose trailing refresh waits; on a node on a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coalescer import Claim, Coalescer
from coalescer.config.code_rules import Rule, Rules
from tests.conftest import Start
from tests.edges.test_leading_edge import RULES, setup
from tests.helpers.e2e import recorder_rules, settled
from tests.helpers.servers import wait_until

CALLS: list[list[Claim]] = []


async def group_made(r: Any, stream: str) -> bool:
    """Whether the source has made its group on ``stream`` (it reads new entries only)."""
    return bool(await r.exists(stream)) and bool(await r.xinfo_groups(stream))


async def batch_refresh(claims: list[Claim]) -> None:
    CALLS.append(list(claims))


async def test_a_batched_rated_leading_rule_runs_each_first_touch_at_once(
        redis_url: str, namespace: str) -> None:
    CALLS.clear()
    rules = Rules(namespace=namespace, rules=[
        Rule(name="b", match="b:{id}", handler=batch_refresh, edge="leading",
             batch={"max": 4}, rate="100/s", window="5s", max_wait="10s")])
    async with Coalescer(rules.config, redis_url=redis_url, worker=True,
                         node_id="n1") as c:
        for i in range(6):
            c.touch(f"b:{i}")
        await c.flush()
        await wait_until(lambda: sum(len(call) for call in CALLS) == 6, timeout=3,
                         message="every key's leading refresh, well before the window")
    claims = [claim for call in CALLS for claim in call]
    assert sorted(claim.key for claim in claims) == [f"b:{i}" for i in range(6)]
    assert all(claim.due_ms == claim.first_touch_ms for claim in claims)
    assert all(len(call) <= 4 for call in CALLS)


async def test_run_now_starts_a_waiting_trailing_refresh_of_a_leading_rule(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, window="5s", max_wait="10s")
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", item="a")
    await c.flush()
    await wait_until(lambda: settled(redis_client, namespace),
                     message="the leading refresh done and acked")
    c.touch("lead:1", item="b")  # not quiet: due a window (5 s) later
    await c.flush()
    outcome = await c.query.run_now(["lead:1"])
    assert (outcome.run, outcome.states) == (["lead:1"], {"lead:1": "hastened"})
    await wait_until(lambda: len(rec.of("lead:1")) == 2, timeout=3,
                     message="the trailing refresh, made due now")
    assert list(rec.of("lead:1")[1].items) == ["b"]


async def test_a_stream_entry_refreshes_a_quiet_leading_key_at_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    stream = f"{namespace}-app:orders"
    text = RULES.format(ns=namespace, window="5s", max_wait="10s") + (
        f'sources:\n  - name: orders\n    stream: "{stream}"\n'
        '    key: "lead:{customer_id}"\n')
    path, rec = recorder_rules(tmp_path, f"leadsrc_{namespace}", text)
    c = await start(path, redis_url=redis_url, node_id="n1")
    await wait_until(lambda: group_made(redis_client, stream), message="the source's group")
    await redis_client.xadd(stream, {"customer_id": "7"})
    await wait_until(lambda: len(rec.of("lead:7")) == 1, timeout=3,
                     message="the leading refresh, well before the window")
    claim = rec.of("lead:7")[0]
    assert claim.due_ms == claim.first_touch_ms
    assert c.config.rule_for("lead:7").leading
