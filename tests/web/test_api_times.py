"""POST /touch with "at" or "delay": real HTTP against a real node on a real server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from coalescer.store import key_states as states
from tests.web.test_api import NodeFactory, make_node

__all__ = ["make_node"]  # the fixture, used by name


async def pending(node: Any, key: str) -> states.Pending | None:
    await node.c.flush()
    value = await node.c.redis.hget(node.c.keyspace.shard(0).meta, key)
    if isinstance(value, bytes):
        value = value.decode()
    return None if value is None else states.pending(value)


async def test_touch_with_at_or_delay_schedules_the_keys(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(days=7)
    status, body = await node.touch({"keys": ["stats:user:1"], "at": when.isoformat()})
    assert (status, body) == (202, {"accepted": 1})
    assert await node.touch({"keys": ["stats:user:2"], "at": when.timestamp()}) == (
        202, {"accepted": 1})
    assert await node.touch({"keys": ["stats:user:3"], "delay": "30m"}) == (
        202, {"accepted": 1})
    for key in ("stats:user:1", "stats:user:2"):
        found = await pending(node, key)
        assert found is not None and found.due_ms == int(when.timestamp()) * 1000
    found = await pending(node, "stats:user:3")
    assert found is not None and found.scheduled
    assert found.due_ms - found.first_ms == 1_800_000


@pytest.mark.parametrize(("time_fields", "field", "says"), [
    ({"at": "2030-01-01T12:00:00"}, "at", "a naive datetime"),
    ({"at": "tomorrow"}, "at", "not a time"),
    ({"at": [1]}, "at", "not a time"),
    ({"delay": "-5s"}, "delay", "a negative delay"),
    ({"delay": "soon"}, "delay", "not a delay"),
    ({"delay": [5]}, "delay", "not a delay"),
    ({"delay": 1e12}, "delay", "more than limits.max_schedule_ahead (400d) ahead"),
    ({"delay": "401d"}, "delay", "401d is more than limits.max_schedule_ahead (400d)"),
    ({"at": "2099-01-01T00:00:00Z"}, "at",
     "2099-01-01T00:00:00+00:00 is more than limits.max_schedule_ahead (400d)"),
    ({"at": "1969-12-31T23:59:59+00:00"}, "at", "is before the epoch (1970-01-01T00:00:00Z)"),
    ({"at": "1960-01-01T00:00:00+05:00"}, "at", "1959-12-31T19:00:00+00:00 is before the epoch"),
    ({"at": 1, "delay": 1}, "at, delay", "give at or delay, not both"),
])
async def test_a_bad_time_is_400_naming_it_and_applies_nothing(
        make_node: NodeFactory, time_fields: dict[str, Any], field: str, says: str) -> None:
    node = await make_node(worker=False)
    status, body = await node.touch({"keys": ["stats:user:1"], **time_fields})
    assert status == 400
    assert body["field"] == field
    assert says in body["error"] and "nothing was touched" in body["error"]
    assert await node.pending() == 0
