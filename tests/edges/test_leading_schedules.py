"""``edge: leading`` with a touch's own time (``at``) and with a rule's ``rate``, on a node
on a real server (server clock): a scheduled touch keeps its exact time, whether the
key is quiet or its leading refresh is running; a plain touch after a schedule leads
only on a quiet key; a rate holds leading refreshes back (none dropped, none split)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import Start
from tests.edges.test_leading_edge import RULES, quiet_down, setup
from tests.helpers.e2e import recorder_rules, server_ms
from tests.helpers.servers import wait_until


async def test_an_at_touch_of_a_quiet_key_runs_at_its_time_not_at_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    at = await server_ms(redis_client) + 500
    c.touch("lead:1", item="a", at=at / 1000)
    await c.flush()
    await quiet_down(redis_client, namespace)
    [claim] = rec.of("lead:1")  # no leading run before it, no second one after
    assert claim.due_ms == at
    assert rec.start_ms[0] >= at
    assert list(claim.items) == ["a"]


async def test_an_at_touch_during_the_leading_run_keeps_its_exact_time(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    gate = rec.hold_first()
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", item="first")
    await c.flush()
    await wait_until(lambda: len(rec.calls) == 1, message="the leading refresh running")
    at = await server_ms(redis_client) + 700  # past the 300 ms window of a plain touch
    c.touch("lead:1", item="scheduled", at=at / 1000)
    await c.flush()
    gate.set()
    await quiet_down(redis_client, namespace)
    first, second = rec.of("lead:1")  # exactly one more, at the touch's own time
    assert first.due_ms == first.first_touch_ms
    assert second.due_ms == at
    assert rec.start_ms[1] >= at
    assert (list(first.items), list(second.items)) == (["first"], ["scheduled"])


async def test_a_plain_touch_after_a_schedule_trails_until_the_key_is_quiet(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = setup(tmp_path, namespace, window="5s", max_wait="10s")
    c = await start(path, redis_url=redis_url, node_id="n1", worker=False)
    c.touch("lead:1", delay=60)
    await c.flush()
    scheduled = await c.query.explain("lead:1")
    assert scheduled["due_reason"] == "scheduled"
    assert scheduled["scheduled_ms"] == scheduled["due_ms"]
    c.touch("lead:1")  # within a window of the scheduled touch: not quiet
    await c.flush()
    info = await c.query.explain("lead:1")
    assert info["due_reason"] == "window"
    assert info["due_ms"] == info["last_touch_ms"] + 5000
    assert info["scheduled_ms"] is None


RATED = RULES.replace("    edge: leading\n", "    edge: leading\n    rate: 1/m\n")


async def test_a_rate_holds_leading_refreshes_back_and_later_touches_join_them(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    text = RATED.format(ns=namespace, window="5s", max_wait="10s")
    path, rec = recorder_rules(tmp_path, f"leadrate_{namespace}", text)
    c = await start(path, redis_url=redis_url, node_id="n1")
    keys = [f"lead:{i}" for i in range(3)]
    for key in keys:
        c.touch(key, item="first")
    await c.flush()
    await wait_until(lambda: len(rec.succeeded) == 1, message="one leading refresh")
    await wait_until(lambda: c.metrics.held_by_rate() == 2, message="two held by the rate")
    held = sorted(set(keys) - {rec.calls[0].key})
    for key in held:  # their leading refreshes are not claimed yet: these join them
        c.touch(key, item="second")
    await c.flush()
    for key in held:
        info = await c.query.explain(key)
        assert (info["state"], info["due_reason"]) == ("pending", "leading")
        assert info["due_ms"] == info["first_touch_ms"]
        assert info["rate_wait"] == {"rate": "1/m", "due_now": 2}
    assert len(rec.calls) == 1  # the bucket refills in a minute
    await c.close()  # a drain runs every due key whatever the rate: here, the held ones
    writer = await start(path, redis_url=redis_url, node_id="n2", worker=False)
    drained = await writer.drain(timeout=10)
    assert sorted((claim.key, sorted(claim.items)) for claim in drained) == [
        (key, ["first", "second"]) for key in held]
    assert sorted(claim.key for claim in rec.calls) == keys  # one refresh each
