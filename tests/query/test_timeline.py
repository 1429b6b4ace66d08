"""A key's timeline (Coalescer.query.timeline): the events the scripts record for its
touches, schedules, claims and outcomes, bounded per key, deleted with the key, counted by
the byte quota, and the answer to "which refresh covered my write at T?"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from coalescer import Coalescer, UnknownKeyError
from coalescer.errors import InvalidKeyError
from coalescer.query.timeline import parse_at
from coalescer.query.timeline_events import EVENTS, KEEP_MS
from coalescer.query.timeline_text import format_timeline
from coalescer.store.byte_count import ByteCount
from coalescer.store.keys import ShardKeys
from tests.helpers.e2e import server_ms
from tests.helpers.inspection import fast_rules, node, write
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
claim_lease: 5s
rules:
  - name: slow-window
    match: "w:{{id}}"
    window: 2s
    max_wait: 30s
    absorb: 10ms
    handler: {{mod}}:refresh
  - name: capped
    match: "bad:{{id}}"
    window: 400ms
    max_wait: 400ms
    absorb: 10ms
    retry: {{attempts: 1, backoff: 20ms, max_backoff: 20ms}}
    handler: {{mod}}:refresh
  - name: retried
    match: "bad:r:{{id}}"
    window: 50ms
    max_wait: 1s
    absorb: 10ms
    retry: {{attempts: 2, backoff: 1m, max_backoff: 1m}}
    handler: {{mod}}:refresh
  - name: later
    match: "ok:{{id}}"
    window: 60s
    max_wait: 2m
    handler: {{mod}}:refresh
"""


async def touched(c: Coalescer, key: str, times: int) -> None:
    """``times`` touches of ``key``, each its own write to Redis."""
    for _ in range(times):
        c.touch(key)
        await c.flush()


async def next_step(redis: Any, step_ms: int) -> None:
    """Wait until the server clock is in a later step of ``step_ms`` than now (1: the
    next millisecond, 1000: the next second)."""
    start = await server_ms(redis) // step_ms

    async def later() -> bool:
        return await server_ms(redis) // step_ms > start
    await wait_until(later, message=f"the server clock's next {step_ms} ms")


async def run_of(c: Coalescer, key: str, outcome: str) -> dict[str, Any]:
    """The timeline of ``key`` once a run ended with ``outcome`` ("dead": dead-lettered)."""
    async def ended() -> dict[str, Any] | None:
        info = await c.query.timeline(key)
        done = [r for r in info["runs"] if r["outcome"] == outcome
                or (outcome == "dead" and (r["next"] or {}).get("kind") == "dead")]
        return info if done else None
    found: dict[str, Any] = await wait_until(ended, message=f"{key} {outcome}")
    return found


async def test_a_burst_its_claim_and_success_then_touches_by_second(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    sk = ShardKeys(namespace, 0)
    async with node(rules, redis_url, worker=False) as writer:
        await touched(writer, "w:1", 3)
        await next_step(redis_client, 1000)
        await touched(writer, "w:1", 2)
        assert await redis_client.exists(sk.timeline("w:1")) == 0  # never claimed: nothing
        before_claim = await server_ms(redis_client)
        pending = await writer.query.timeline("w:1", at_ms=before_claim)
        [burst] = pending["events"]  # from its state: first to last touch, and the count
        assert burst["count"] == 5 and burst["until_ms"] == pending["state"]["last_touch_ms"]
        assert burst["at_ms"] == pending["state"]["first_touch_ms"]
        assert pending["at"]["status"] == "pending"
        assert pending["at"]["answer"].startswith("not yet refreshed: pending, due at")
        async with node(rules, redis_url, node_id="node-t") as worker:
            info = await run_of(worker, "w:1", "success")
            answer = await worker.query.timeline("w:1", at_ms=before_claim)
        await touched(writer, "w:1", 2)  # a new burst: the key has a timeline now
        await next_step(redis_client, 1000)
        await touched(writer, "w:1", 1)
        again = await writer.query.timeline("w:1")
    kinds = [e["type"] for e in info["events"]]
    assert kinds == ["touches", "claim", "outcome"]
    claim, outcome = info["events"][1], info["events"][2]
    assert claim["node"] == "node-t" and claim["attempt"] == 1 and claim["touches"] == 5
    assert claim["due_reason"] == "window" and claim["items"] is None
    assert outcome["token"] == claim["token"] and outcome["outcome"] == "success"
    assert outcome["duration_ms"] is not None and outcome["next"] is None
    assert info["state"]["state"] == "idle"
    [run] = info["runs"]
    assert run["token"] == claim["token"] and run["outcome"] == "success"
    assert answer["at"]["status"] == "covered" and answer["at"]["run"]["token"] == claim["token"]
    assert answer["at"]["answer"].startswith("covered by the refresh claimed at")
    assert "node node-t" in answer["at"]["answer"]
    text = format_timeline(answer)
    assert "touched 5 times from then to" in text
    assert "claimed by node node-t" in text and "success in" in text
    assert "covered by the refresh" in text
    buckets = [(e["count"], e["until_ms"]) for e in again["events"][3:]]
    assert buckets == [(2, None), (1, None)]  # by the second, counted
    assert "touched 2 times in this second" in format_timeline(again)


async def claimed_once(c: Coalescer, key: str) -> None:
    """``key`` touched, run now and refreshed: it has a timeline."""
    c.touch(key)
    await c.flush()
    await c.query.run_now([key])
    await run_of(c, key, "success")


async def test_max_wait_forcing_a_failure_dead_letter_and_purge(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    async with node(rules, redis_url, node_id="node-f") as c:
        at = await server_ms(redis_client)
        await touched(c, "bad:1", 1)
        await next_step(redis_client, 1)  # (touches in one millisecond: due by either)
        await touched(c, "bad:1", 1)  # the second touch: due by max_wait, not the window
        info = await run_of(c, "bad:1", "dead")
        claim = next(e for e in info["events"] if e["type"] == "claim")
        assert claim["due_reason"] == "max_wait" and claim["touches"] == 2
        end = next(e for e in info["events"] if e["type"] == "outcome")
        assert "no such user: bad:1" in end["error"] and end["outcome"] == "failure"
        assert end["next"] == {"kind": "dead", "due_ms": None}
        assert info["state"]["state"] == "dead"
        answer = (await c.query.timeline("bad:1", at_ms=at))["at"]
        assert answer["status"] == "failed"
        assert "failure" in answer["answer"] and "dead-lettered" in answer["answer"]
        assert "forced by max_wait" in format_timeline(info)
        sk = ShardKeys(namespace, 0)
        assert await redis_client.exists(sk.timeline("bad:1")) == 1
        assert (await c.query.purge_dead(["bad:1"])).done == 1
        assert await redis_client.exists(sk.timeline("bad:1")) == 0
        assert (await c.query.timeline("bad:1"))["events"] == []


async def test_a_failure_with_a_retry_to_come_is_not_yet_covered(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    async with node(rules, redis_url, node_id="node-r") as c:
        at = await server_ms(redis_client)
        await touched(c, "bad:r:1", 1)
        info = await run_of(c, "bad:r:1", "failure")
        answer = (await c.query.timeline("bad:r:1", at_ms=at))["at"]
    [end] = [e for e in info["events"] if e["type"] == "outcome"]
    assert end["next"]["kind"] == "retry" and end["next"]["due_ms"] > end["at_ms"] + 1000
    assert info["state"]["state"] == "backoff"
    assert answer["status"] == "failed"
    assert answer["answer"].startswith("not refreshed yet: the refresh claimed at")
    assert "no such user: bad:r:1; it runs again, due at" in answer["answer"]
    assert "; retry, due" in format_timeline(info)


async def test_schedules_the_bound_the_expiry_and_a_cancel(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    sk = ShardKeys(namespace, 0)
    async with node(rules, redis_url, node_id="node-s") as c:
        await claimed_once(c, "ok:1")
        for n in range(EVENTS + 5):
            c.touch("ok:1", delay=f"{100 + n}s")
            await c.flush()
        assert await redis_client.llen(sk.timeline("ok:1")) == EVENTS
        assert 0 < await redis_client.pttl(sk.timeline("ok:1")) <= KEEP_MS
        info = await c.query.timeline("ok:1")
        schedules = [e for e in info["events"] if e["type"] == "scheduled"]
        assert len(schedules) == EVENTS
        assert schedules[-1]["due_ms"] - schedules[-1]["at_ms"] == 100_000 + EVENTS + 4 - 1 \
            or schedules[-1]["due_ms"] - schedules[-1]["at_ms"] == (100 + EVENTS + 4) * 1000
        assert "scheduled for" in format_timeline(info)
        c.touch("ok:9", delay="0s")  # a time of its own: due now, claimed as such
        await c.flush()
        claims = [e for e in (await run_of(c, "ok:9", "success"))["events"]
                  if e["type"] == "claim"]
        assert [e["due_reason"] for e in claims] == ["scheduled"]
        await c.cancel("ok:1")
        assert await redis_client.exists(sk.timeline("ok:1")) == 0
        assert (await c.query.timeline("ok:1"))["events"] == []


async def test_the_byte_quota_counts_a_timeline(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    sk = ShardKeys(namespace, 0)
    counter = ByteCount(redis_client, items=False)
    async with node(rules, redis_url, node_id="node-q") as c:
        c.touch("ok:3")  # a key without a timeline: what a pending key counts alone
        await c.flush()
        alone, ended = await counter.count(sk)
        await claimed_once(c, "ok:2")
        assert ended
        added = int(await redis_client.hget(sk.bytes, "added") or 0)
        for n in range(10):
            c.touch("ok:2", delay=f"{200 + n}s")
            await c.flush()
        grown = int(await redis_client.hget(sk.bytes, "added") or 0) - added
        events = await redis_client.lrange(sk.timeline("ok:2"), 0, -1)
        assert grown >= sum(len(e) for e in events)  # seen at once, by the writes
        recounted, ended = await counter.count(sk)
        usage = await redis_client.memory_usage(sk.timeline("ok:2")) or 0
        # a key's name twice, Redis's own 80 bytes and its state; then ok:2's and its timeline
        assert ended and alone < 2 * len("ok:3") + 80 + 30
        assert recounted > alone + int(usage) + 2 * len("ok:2") + 80


async def test_a_key_no_rule_matches_and_one_too_long(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    async with node(rules, redis_url, worker=False) as c:
        with pytest.raises(UnknownKeyError):
            await c.query.timeline("nothing:1")
        with pytest.raises(InvalidKeyError):
            await c.query.timeline("ok:" + "x" * 2000)


@pytest.mark.parametrize(("text", "ms"), [
    ("1733462400.5", 1733462400500), ("2024-12-06T05:20:00Z", 1733462400000),
    ("2024-12-06T06:20:00+01:00", 1733462400000)])
def test_at_reads_epoch_seconds_and_iso_times(text: str, ms: int) -> None:
    assert parse_at(text) == ms


@pytest.mark.parametrize(("text", "says"), [
    ("yesterday", "not a time"), ("-5", "not before 1970"), ("nan", "not a time"),
    ("1" * 65, "over the limit of 64")])
def test_a_bad_at_is_refused_with_what_was_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_at(text)
