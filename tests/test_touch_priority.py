"""``touch(key, priority=...)`` through the Python API, on a real server and a real node:
the forms it takes, the key claimed first among due keys, and every refusal with its
message (a refused call buffers nothing)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from coalescer import InvalidPriorityError, SyncCoalescer
from coalescer.query.explain import format_explain
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules, server_ms
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 5s
rules:
  - name: job
    match: "job:{{id}}"
    priority: 0s
    concurrency: 1
    handler: {{mod}}:refresh
  - name: plain
    match: "plain:{{id}}"
    handler: {{mod}}:refresh
"""


async def priority_ms(redis: Any, namespace: str, key: str) -> int | None:
    value = await redis.hget(KeySpace(namespace, 1).shard(0).meta, key)
    found = None if value is None else states.pending(value)
    return None if found is None else found.priority_ms


async def test_a_touch_with_a_priority_is_refreshed_before_keys_due_earlier(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    writer = await start(path, redis_url=redis_url, worker=False)
    writer.touch_many([f"job:{i}" for i in range(5)])
    await writer.flush()
    writer.touch("job:vip", priority="1m")
    await writer.flush()
    assert await priority_ms(redis_client, namespace, "job:vip") == 60_000
    due = await server_ms(redis_client) + 60
    await wait_until(lambda: _past(redis_client, due), message="the keys due")

    await start(path, redis_url=redis_url)  # a worker, one slot: claims one key a call
    await wait_until(lambda: len(rec.calls) == 6, message="six refreshes")

    assert rec.calls[0].key == "job:vip"
    assert [c.key for c in rec.calls[1:]] == [f"job:{i}" for i in range(5)]


async def _past(redis: Any, ms: int) -> bool:
    return await server_ms(redis) > ms


async def test_priority_takes_seconds_a_timedelta_and_duration_text(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    writer = await start(path, redis_url=redis_url, worker=False)
    writer.touch("job:s", priority=2.5)
    writer.touch("job:td", priority=timedelta(minutes=2))
    writer.touch("job:text", priority="250ms")
    writer.touch_many(["job:m1", "job:m2"], priority="3s")
    writer.touch("job:twice", priority="5s")
    writer.touch("job:twice", priority="1s")  # absorbed: the larger is kept
    await writer.flush()

    found = {k: await priority_ms(redis_client, namespace, f"job:{k}")
             for k in ("s", "td", "text", "m1", "m2", "twice")}
    assert found == {"s": 2500, "td": 120_000, "text": 250, "m1": 3000, "m2": 3000,
                     "twice": 5000}


def test_a_sync_coalescer_touches_with_a_priority(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    path, _ = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    with SyncCoalescer.from_yaml(path, redis_url=redis_url, worker=False) as c:
        c.touch("job:sync", priority=timedelta(seconds=30))
        c.flush()
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        value = client.hget(KeySpace(namespace, 1).shard(0).meta, "job:sync")
    found = states.pending(value)
    assert found is not None and found.priority_ms == 30_000


@pytest.mark.parametrize(("key", "priority", "reason"), [
    ("job:1", -1, "negative: a priority is >= 0"),
    ("job:1", "-2s", "negative: a priority is >= 0"),
    ("job:1", timedelta(seconds=-1), "negative: a priority is >= 0"),
    ("job:1", "soon", "not a priority"),
    ("job:1", True, "not a priority"),
    ("job:1", "400d", "more than a year and a day"),
    ("plain:1", "1s", "rule 'plain' orders its due keys by due time only"),
])
async def test_a_bad_priority_is_refused_naming_the_key_and_value(  # noqa: PLR0917
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, start: Start,
        key: str, priority: object, reason: str) -> None:
    path, _ = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    writer = await start(path, redis_url=redis_url, worker=False)

    with pytest.raises(InvalidPriorityError) as info:
        writer.touch(key, priority=priority)  # type: ignore[arg-type]
    with pytest.raises(InvalidPriorityError):
        writer.touch_many(["job:ok", key], priority=priority)  # type: ignore[arg-type]
    await writer.flush()

    text = str(info.value)
    assert text.startswith(f"priority {priority!r} of the touch of key {key!r} refused: ")
    assert reason in text
    assert await redis_client.hlen(KeySpace(namespace, 1).shard(0).meta) == 0


async def test_explain_reads_the_re_arm_of_a_running_key_touched_with_a_priority(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    writer = await start(path, redis_url=redis_url, worker=False)
    meta = KeySpace(namespace, 1).shard(0).meta
    await redis_client.hset(meta, "job:1", "R|5|100|200|1|300|900!n5c|800|850|n1")

    again = (await writer.query.explain("job:1"))["running"]["touched_again"]

    assert again == {"first_touch_ms": 800, "last_touch_ms": 850, "due_ms": 900,
                     "scheduled_ms": None}


async def test_explain_shows_the_priority_a_pending_keys_touches_gave(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, _ = recorder_rules(tmp_path, f"prio_{namespace}", RULES.format(ns=namespace))
    writer = await start(path, redis_url=redis_url, worker=False)
    writer.touch("job:1", priority="30s")
    writer.touch("job:2")
    await writer.flush()

    info, plain = await writer.query.explain("job:1"), await writer.query.explain("job:2")

    assert info["priority_ms"] == 30_000 and plain["priority_ms"] is None
    assert "priority   30s (its touches': claimed among due keys as if due that much " \
           "earlier)" in format_explain(info)
    assert "priority" not in format_explain(plain)
