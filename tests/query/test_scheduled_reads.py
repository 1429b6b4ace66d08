"""What explain and status say of keys waiting for a time a touch set (at/delay), on a
real server: explain's "scheduled for", status's count per rule and next one due, and a
cancel dropping a schedule with the history saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coalescer.query.explain import format_explain
from coalescer.query.status import format_status
from tests.conftest import Start
from tests.helpers.e2e import server_ms
from tests.test_schedule import due_of, setup


async def test_explain_and_status_show_scheduled_keys_and_cancel_drops_one(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch("order:1", delay="1h")
    c.touch("order:2", delay="2h")
    c.touch("order:3", delay="30m")
    c.touch("order:plain")
    await c.flush()
    due = await due_of(redis_client, namespace, "order:1")

    info = await c.query.explain("order:1")
    assert (info["state"], info["due_reason"], info["scheduled_ms"]) == (
        "pending", "scheduled", due)
    text = format_explain(info)
    assert "pending: scheduled for" in text and "(in 3" in text
    plain = await c.query.explain("order:plain")
    assert (plain["due_reason"], plain["scheduled_ms"]) == ("window", None)

    status = await c.query.status()
    entry = status["rules"]["order"]
    assert (entry["pending"], entry["scheduled"], entry["scheduled_capped"]) == (4, 3, False)
    assert entry["next_scheduled_ms"] == await due_of(redis_client, namespace, "order:3")
    lines = format_status(status, await server_ms(redis_client)).splitlines()
    assert any(line.startswith("order: 3 scheduled keys of the pending, the next due in ")
               for line in lines)

    outcome = await c.cancel("order:1")
    assert outcome.states == {"order:1": "pending"}
    info = await c.query.explain("order:1")
    assert info["state"] == "idle"
    assert (info["last_refreshes"][0]["outcome"], info["last_refreshes"][0]["due_ms"]) == (
        "cancelled", due)
    assert (await c.query.status())["rules"]["order"]["scheduled"] == 2


def test_explain_says_when_a_running_key_runs_again_at_its_scheduled_time() -> None:
    from coalescer.config.rules import Config
    from coalescer.query.explain import describe_state, rule_settings

    config = Config.from_string(
        "rules:\n  - {name: order, match: 'order:{id}', handler: builtins:repr}\n")
    now = 1_000_000
    state = describe_state("R|5|900000|900000|1|900000|S1090000|950000|950000|n1",
                           config.rules[0], {"inflight": now + 5000, "dead": None}, now)
    again = state["running"]["touched_again"]
    assert (again["due_ms"], again["scheduled_ms"]) == (1_090_000, 1_090_000)
    text = format_explain({**state, "key": "order:1", "shard": 0, "now_ms": now,
                           "rule": rule_settings(config.rules[0]), "items": None,
                           "last_refreshes": []})
    assert "runs again scheduled for" in text and "(in 90.0 s)" in text
