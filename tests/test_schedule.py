"""Touches with a time of their own (``at``/``delay``) through the Python API, on a real
server: the forms each accepts, every refusal with its message, that a refused call
buffers nothing and loses nothing, and the order of touches of one key in one write."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer, InvalidScheduleError, SyncCoalescer, UnknownKeyError
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules, server_ms
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 200ms
  max_wait: 1s
  absorb: 10ms
  timeout: 5s
rules:
  - name: order
    match: "order:{{id}}"
    handler: {{mod}}:refresh
  - name: bag
    match: "bag:{{id}}"
    items: {{max: 10}}
    handler: {{mod}}:refresh
"""
DAY_MS = 86_400_000


def setup(tmp_path: Path, namespace: str) -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"sched_{namespace}", RULES.format(ns=namespace))


async def pending(redis: Any, namespace: str, key: str) -> states.Pending | None:
    value = await redis.hget(KeySpace(namespace, 1).shard(0).meta, key)
    return None if value is None else states.pending(value)


async def due_of(redis: Any, namespace: str, key: str) -> int:
    found = await pending(redis, namespace, key)
    assert found is not None, f"{key} is not pending"
    return found.due_ms


@pytest.fixture
async def writer(tmp_path: Path, namespace: str, redis_url: str, start: Start) -> Coalescer:
    path, _ = setup(tmp_path, namespace)
    return await start(path, redis_url=redis_url, worker=False)


async def test_at_takes_an_aware_datetime_epoch_seconds_and_iso_text(
        writer: Coalescer, redis_client: Any, namespace: str) -> None:
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(days=3)
    ms = int(when.timestamp()) * 1000
    eastern = when.astimezone(timezone(timedelta(hours=-5)))
    writer.touch("order:dt", at=eastern)
    writer.touch("order:int", at=int(when.timestamp()) + 1)
    writer.touch("order:float", at=when.timestamp() + 1.5)
    writer.touch("order:iso", at=eastern.isoformat())
    writer.touch("order:z", at=when.strftime("%Y-%m-%dT%H:%M:%SZ"))
    await writer.flush()
    assert [await due_of(redis_client, namespace, f"order:{k}")
            for k in ("dt", "int", "float", "iso", "z")] == [
        ms, ms + 1000, ms + 1500, ms, ms]


async def test_delay_takes_seconds_and_duration_strings_from_the_server_clock(
        writer: Coalescer, redis_client: Any, namespace: str) -> None:
    forms: dict[str, Any] = {"a": 90, "b": 2.5, "c": "30m", "d": "1.5s", "e": "2h"}
    expected = {"a": 90_000, "b": 2500, "c": 1_800_000, "d": 1500, "e": 7_200_000}
    before = await server_ms(redis_client)
    for key, delay in forms.items():
        writer.touch(f"order:{key}", delay=delay)
    await writer.flush()
    after = await server_ms(redis_client)
    for key, ms in expected.items():
        due = await due_of(redis_client, namespace, f"order:{key}")
        assert before + ms <= due <= after + ms, key


@pytest.mark.parametrize(("options", "words"), [
    ({"at": datetime(2030, 1, 1, 12, 0)}, "a naive datetime"),
    ({"at": "tomorrow at noon"}, "not a time"),
    ({"at": "2030-01-01T12:00:00"}, "a naive datetime"),
    ({"at": True}, "not a time"),
    ({"at": -5}, "finite number >= 0"),
    ({"at": float("nan")}, "finite number >= 0"),
    ({"at": time.time() + 11 * 365 * 86_400}, "more than limits.max_schedule_ahead (400d) ahead"),
    ({"delay": -1}, "a negative delay"),
    ({"delay": "-5s"}, "a negative delay"),
    ({"delay": "soon"}, "not a delay"),
    ({"delay": "100000h"}, "more than limits.max_schedule_ahead (400d) ahead"),
    ({"delay": "401d"}, "401d is more than limits.max_schedule_ahead (400d) ahead"),
    ({"at": "2099-01-01T00:00:00Z"}, "2099-01-01T00:00:00+00:00 is more than "
     "limits.max_schedule_ahead (400d) ahead"),
    ({"at": "1969-12-31T23:59:59+00:00"}, "before the epoch (1970-01-01T00:00:00Z)"),
    ({"at": datetime(1960, 1, 1, tzinfo=UTC)}, "1960-01-01T00:00:00+00:00 is before the epoch"),
    ({"at": 1, "delay": 1}, "give at or delay, not both"),
])
async def test_a_bad_time_is_refused_naming_the_key_and_the_value(
        writer: Coalescer, redis_client: Any, namespace: str, options: dict[str, Any],
        words: str) -> None:
    writer.touch("order:kept")
    with pytest.raises(InvalidScheduleError) as refused:
        writer.touch("order:1", **options)
    message = str(refused.value)
    assert words in message and "'order:1'" in message
    shown = next(iter(options.values())) if len(options) == 1 else None
    if shown is not None and not isinstance(shown, float):
        assert repr(shown) in message
    assert isinstance(refused.value, ValueError)
    await writer.flush()
    assert await pending(redis_client, namespace, "order:1") is None
    assert await pending(redis_client, namespace, "order:kept") is not None  # not lost


async def test_touch_many_checks_every_key_and_the_time_before_buffering_any(
        writer: Coalescer, redis_client: Any, namespace: str) -> None:
    with pytest.raises(InvalidScheduleError, match=r"'order:1 \(and 1 more\)'"):
        writer.touch_many(["order:1", "order:2"], delay="-1s")
    with pytest.raises(UnknownKeyError):
        writer.touch_many(["order:1", "nope:2"], delay="1h")
    with pytest.raises(InvalidScheduleError):
        await writer.touch_many_wait(["order:1"], at="never")
    await writer.flush()
    assert await pending(redis_client, namespace, "order:1") is None
    writer.touch_many(["order:1", "order:2"], delay="1h")
    await writer.touch_many_wait(["order:3"], delay="1h")
    await writer.touch_wait("order:4", delay="1h")
    await writer.flush()
    for key in ("order:1", "order:2", "order:3", "order:4"):
        found = await pending(redis_client, namespace, key)
        assert found is not None and found.scheduled, key


async def test_touches_of_one_key_in_one_write_apply_in_order(
        writer: Coalescer, redis_client: Any, namespace: str) -> None:
    far = time.time() + 20 * 86_400
    before = await server_ms(redis_client)  # the flusher may write before flush()
    writer.touch("order:then-plain", at=far)
    writer.touch("order:then-plain")  # a plain touch after it: the debounce decides
    writer.touch("order:then-timed")
    writer.touch("order:then-timed", at=far)
    writer.touch("order:twice", at=far)
    writer.touch("order:twice", at=far + 60)  # the latest schedule wins
    writer.touch("order:then-plain-many", at=far)
    writer.touch_many(["order:then-plain-many"])
    await writer.flush()
    after = await server_ms(redis_client)
    for key in ("order:then-plain", "order:then-plain-many"):
        found = await pending(redis_client, namespace, key)
        assert found is not None and not found.scheduled
        assert before + 200 <= found.due_ms <= after + 200
    assert await due_of(redis_client, namespace, "order:then-timed") == round(far * 1000)
    assert await due_of(redis_client, namespace, "order:twice") == round((far + 60) * 1000)


async def test_an_item_touched_with_a_time_reaches_the_refresh(
        writer: Coalescer, redis_client: Any, namespace: str) -> None:
    writer.touch("bag:1", "row-1", delay="1h")
    writer.touch_items([("bag:1", "row-2")], delay="2h")
    await writer.flush()
    found = await pending(redis_client, namespace, "bag:1")
    assert found is not None and found.scheduled
    [claim] = await writer.drain(timeout=10)
    assert claim.items == ("row-1", "row-2")


async def test_a_scheduled_key_is_refreshed_at_its_time_not_before(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, worker=True)
    c.touch("order:1", delay="3s")  # later than its rule's window and max_wait
    await c.flush()
    due = await due_of(redis_client, namespace, "order:1")
    await wait_until(lambda: rec.calls, timeout=15, message="the scheduled refresh")
    [claim] = rec.calls
    assert claim.due_ms == due
    assert rec.start_ms[0] >= due


def test_sync_coalescer_touches_with_a_time(tmp_path: Path, namespace: str,
                                            redis_url: str) -> None:
    path, _ = setup(tmp_path, namespace)
    with SyncCoalescer.from_yaml(path, redis_url=redis_url, worker=False) as c:
        c.touch("order:1", delay="1h")
        c.touch_many(["order:2"], at=time.time() + 3600)
        c.touch_wait("order:3", delay=60)
        with pytest.raises(InvalidScheduleError, match="a naive datetime"):
            c.touch("order:4", at=datetime(2030, 1, 1))
        c.flush()
        found = asyncio.run(_scheduled(redis_url, namespace, ["order:1", "order:2", "order:3"]))
    assert found == [True, True, True]


async def _scheduled(redis_url: str, namespace: str, keys: list[str]) -> list[bool]:
    import redis.asyncio
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        return [bool((p := await pending(client, namespace, k)) and p.scheduled) for k in keys]
    finally:
        await client.aclose()
