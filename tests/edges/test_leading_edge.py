"""``edge: leading`` end to end, in process, on a real server: the first touch of a quiet
key refreshes it at once; touches after that refresh started make exactly one more,
a window after the last of them; nothing else runs. Times are the server clock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coalescer.query.explain import format_explain
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules, server_ms, settled
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
claim_lease: 2s
defaults:
  window: {window}
  max_wait: {max_wait}
  absorb: 5ms
  timeout: 5s
  retry: {{attempts: 3, backoff: 20ms, max_backoff: 50ms}}
rules:
  - name: lead
    match: "lead:{{id}}"
    edge: leading
    items: {{max: 100}}
    handler: {{mod}}:refresh
  - name: trail
    match: "trail:{{id}}"
    handler: {{mod}}:refresh
"""


def setup(tmp_path: Path, namespace: str, window: str = "300ms",
          max_wait: str = "2s") -> tuple[Path, Recorder]:
    text = RULES.format(ns=namespace, window=window, max_wait=max_wait)
    return recorder_rules(tmp_path, f"lead_{namespace}", text)


async def quiet_down(r: Any, namespace: str) -> None:
    await wait_until(lambda: settled(r, namespace), timeout=10,
                     message="every key refreshed and acked")


async def test_a_single_touch_of_a_quiet_key_runs_once_at_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, window="2s", max_wait="4s")
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", item="a")
    c.touch("trail:1")
    await c.flush()
    await wait_until(lambda: len(rec.of("lead:1")) == 1, timeout=1.5,
                     message="the leading refresh, well before the window")
    claim = rec.of("lead:1")[0]
    assert claim.due_ms == claim.first_touch_ms  # due at its first touch
    assert claim.items == ("a",) or list(claim.items) == ["a"]
    assert rec.of("trail:1") == []  # the trailing rule waits its window
    await quiet_down(redis_client, namespace)
    assert len(rec.of("lead:1")) == 1  # no second run without a later touch
    assert len(rec.of("trail:1")) == 1


async def test_touches_after_the_leading_run_started_make_exactly_one_more(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    gate = rec.hold_first()
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", item="first")
    await c.flush()
    await wait_until(lambda: len(rec.calls) == 1, message="the leading refresh running")
    for n in range(5):
        c.touch("lead:1", item=f"during-{n}")
        await c.flush()
    last_touch = await server_ms(redis_client)
    gate.set()
    await wait_until(lambda: len(rec.calls) == 1 and not rec.active["lead:1"],
                     message="the leading refresh done")
    assert len(rec.calls) == 1  # the trailing one waits a window after the last touch
    await quiet_down(redis_client, namespace)

    first, second = rec.of("lead:1")
    assert sorted(first.items) == ["first"]
    assert sorted(second.items) == [f"during-{n}" for n in range(5)]
    assert second.due_ms >= second.last_touch_ms + 300
    assert second.last_touch_ms <= last_touch
    assert rec.start_ms[1] >= second.due_ms
    assert second.token > first.token


async def test_a_cancel_forgets_the_last_touch_so_the_next_one_leads(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, window="5s", max_wait="10s")
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1")
    await c.flush()
    await quiet_down(redis_client, namespace)  # the leading refresh ran and was acked
    assert len(rec.of("lead:1")) == 1
    quiet_key = f"{namespace}:{{{namespace}:0}}:quiet:lead:1"
    assert await redis_client.exists(quiet_key) == 1  # the key is not quiet yet
    await c.cancel("lead:1")
    assert await redis_client.exists(quiet_key) == 0
    c.touch("lead:1")
    await c.flush()
    await wait_until(lambda: len(rec.of("lead:1")) == 2, timeout=3,
                     message="a second leading refresh, well before the window")
    again = rec.of("lead:1")[1]
    assert again.due_ms == again.first_touch_ms


async def test_a_touch_with_a_time_of_its_own_keeps_it_on_a_leading_rule(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", delay=0.4)
    await c.flush()
    await quiet_down(redis_client, namespace)
    [claim] = rec.of("lead:1")
    assert claim.due_ms == claim.first_touch_ms + 400  # its own time, not at once
    assert rec.start_ms[0] >= claim.due_ms


async def test_a_touch_after_the_leading_run_ended_but_within_the_window_trails(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("lead:1", item="a")
    await c.flush()
    await quiet_down(redis_client, namespace)  # the leading refresh ran and ended
    c.touch("lead:1", item="b")
    await c.flush()
    await quiet_down(redis_client, namespace)
    first, second = rec.of("lead:1")
    assert second.first_touch_ms - first.first_touch_ms < 300  # not quiet yet
    assert second.due_ms == second.last_touch_ms + 300  # so a window after it
    assert (sorted(first.items), sorted(second.items)) == (["a"], ["b"])


async def test_a_paused_leading_rule_runs_once_on_resume(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, node_id="n1")
    assert await c.query.pause("lead")
    for n in range(3):
        c.touch("lead:1", item=f"i{n}")
        await c.flush()
    await asyncio.sleep(0.5)  # a window and more: nothing may run while paused
    assert rec.of("lead:1") == []
    assert await c.query.resume("lead")
    await quiet_down(redis_client, namespace)
    [claim] = rec.of("lead:1")  # the leading refresh, with every touch made before it
    assert sorted(claim.items) == ["i0", "i1", "i2"]


async def test_drain_runs_a_leading_burst_once(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = setup(tmp_path, namespace, window="5s", max_wait="10s")
    c = await start(path, redis_url=redis_url, node_id="n1", worker=False)
    c.touch("lead:1", item="a")
    c.touch("lead:1", item="b")
    claims = await c.drain()
    assert [(cl.key, sorted(cl.items)) for cl in claims] == [("lead:1", ["a", "b"])]
    assert await c.drain() == []


async def test_explain_says_a_leading_key_is_due_at_its_first_touch(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, node_id="n1", worker=False)
    c.touch("lead:1")
    c.touch("trail:1")
    await c.flush()
    info = await c.query.explain("lead:1")
    assert (info["state"], info["due_reason"], info["rule"]["edge"]) == (
        "pending", "leading", "leading")
    assert info["due_ms"] == info["first_touch_ms"]
    text = format_explain(info)
    assert "the leading edge: the first touch of a quiet key runs at once" in text
    assert "edge: leading" in text
    trailing = await c.query.explain("trail:1")
    assert (trailing["due_reason"], trailing["rule"]["edge"]) == ("window", "trailing")
    assert "edge: leading" not in format_explain(trailing)
