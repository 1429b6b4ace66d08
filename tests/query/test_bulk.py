"""Bulk actions by filter on a real server: a dry run counts and changes nothing; retry,
purge, cancel and run-now act only on the keys the filter finds, a page at a time;
a stop ends the action after the page under way; an action refuses the states it
does not act on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.query.bulk import (
    RANKS_AT_ONCE,
    REQUEUE_AT_ONCE,
    BulkProgress,
    action_state,
    scripted_act,
)
from coalescer.query.key_search import SearchError, make_filter
from coalescer.store.keys import KeySpace
from coalescer.store.scripts import Scripts
from tests.conftest import Start
from tests.query.test_key_search import started

NOW_MS = int(time.time() * 1000)  # dead letters of now: none past dead_letter_ttl


async def kill(redis: Any, namespace: str, keys: list[str]) -> None:
    """Dead-letter ``keys`` (rule acct) as fail.lua leaves them."""
    space = KeySpace(namespace, 3)
    for n, key in enumerate(keys):
        sk = space.shard(space.shard_of(key))
        await redis.hset(sk.meta, key, "D|1|1|5|boom")
        await redis.zadd(sk.dead("acct"), {key: NOW_MS + n})


async def cancel_count(c: Coalescer) -> Any:
    async def cancel(keys: list[str]) -> int:
        return (await c.cancel_many(keys)).done
    return cancel


async def bulk(c: Coalescer, action: str, where: list[str], *, dry_run: bool = False,
               state: str | None = None, rate: int = 0, on_page: Any = None) -> BulkProgress:
    search = make_filter(c.config, "acct", state=action_state(action, state), where=where)
    progress = BulkProgress(action, search, dry_run=dry_run, rate=rate)
    return await c.query.bulk(progress, await cancel_count(c), on_page)


async def test_retry_by_capture_counts_first_then_requeues_only_those(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    dead = [f"acct:{org}:{u}" for org in (1, 2) for u in range(30)]
    await kill(redis_client, namespace, dead)
    counted = await bulk(c, "retry", ["org=2"], dry_run=True)
    assert (counted.status, counted.matched, counted.done) == ("done", 30, 0)
    assert (await c.query.status())["rules"]["acct"]["dead"] == 60
    done = await bulk(c, "retry", ["org=2"])
    assert (done.status, done.matched, done.done) == ("done", 30, 30)
    assert done.summary() == "re-queued 30 of 30 matched (the dead keys of rule acct where org=2)"
    assert (await c.query.explain("acct:2:7"))["state"] == "pending"
    assert (await c.query.explain("acct:1:7"))["state"] == "dead"
    purged = await bulk(c, "purge", ["org=1"])
    assert purged.done == 30
    assert (await c.query.explain("acct:1:7"))["state"] == "idle"


async def test_cancel_and_run_now_by_capture(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    c.touch_many([f"acct:{org}:{u}" for org in (1, 2) for u in range(10)])
    await c.flush()
    made = await bulk(c, "run-now", ["org=1"])
    assert made.done == 10
    info = await c.query.explain("acct:1:3")
    assert info["due_ms"] <= info["now_ms"]
    other = await c.query.explain("acct:2:3")
    assert other["due_ms"] > other["now_ms"] + 3_000_000
    gone = await bulk(c, "cancel", ["org=2"])
    assert (gone.matched, gone.done) == (10, 10)
    assert (await c.query.status())["rules"]["acct"]["pending"] == 10


async def test_a_stop_ends_the_action_after_the_page_under_way(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await kill(redis_client, namespace, [f"acct:1:{u}" for u in range(200)])
    pages: list[int] = []

    def stop_after_two(progress: BulkProgress) -> None:
        pages.append(progress.done)
        if len(pages) == 2:
            progress.stop.set()

    done = await bulk(c, "retry", [], rate=40, on_page=stop_after_two)  # pages of 10
    assert (done.status, len(pages), done.done) == ("aborted", 2, 20)
    assert (await c.query.status())["rules"]["acct"]["dead"] == 180
    assert done.to_json()["status"] == "aborted"


async def test_a_retry_in_several_calls_wakes_the_poller_once_after_its_keys_are_due(
        namespace: str, redis_client: Any) -> None:
    sk = KeySpace(namespace, 1).shard(0)
    dead = [f"acct:1:{u}" for u in range(REQUEUE_AT_ONCE + 5)]
    for key in dead:
        await redis_client.hset(sk.meta, key, "D|1|1|5|boom")
        await redis_client.zadd(sk.dead("acct"), {key: NOW_MS})
    far = str(NOW_MS + 3_600_000)

    async def no_cancel(keys: list[str]) -> int:
        return 0

    retry = scripted_act("retry", redis_client, Scripts(redis_client), "acct", no_cancel)
    for keys, done in ((dead[:REQUEUE_AT_ONCE + 1], REQUEUE_AT_ONCE + 1),  # two calls
                       (dead[REQUEUE_AT_ONCE + 1:] + ["acct:1:gone"] * REQUEUE_AT_ONCE, 4)):
        await redis_client.set(sk.next_wake, far)
        before = int(float((await redis_client.time())[0])) * 1000
        assert await retry(sk, keys) == done
        woken = await redis_client.get(sk.next_wake)
        assert woken is not None and before <= int(woken) < int(far)  # the poller was woken
    assert await redis_client.zcard(sk.dead("acct")) == 0
    assert await redis_client.zcard(sk.due("acct")) == len(dead)


async def test_a_retry_reads_each_page_once_from_where_the_last_ended(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    dead = [f"acct:1:{u}" for u in range(120)]
    await kill(redis_client, namespace, [*dead, "acct:2:1"])
    space = KeySpace(namespace, 3)
    stale = dead[5::20]  # in the dead set, no state: left where they are
    for key in stale:
        await redis_client.hdel(space.shard(space.shard_of(key)).meta, key)
    await redis_client.config_resetstat()
    done = await bulk(c, "retry", ["org=1"], rate=40)  # pages of 10
    stats = await redis_client.info("commandstats")
    assert (done.status, done.matched, done.done) == ("done", 120, 114)
    left = [k for shard in range(3) for k in await redis_client.zrange(
        space.shard(shard).dead("acct"), 0, -1)]
    assert sorted(left) == sorted([*stale, "acct:2:1"])
    assert "cmdstat_zrank" not in stats  # no page had to search for where it starts
    assert stats["cmdstat_zrange"]["calls"] <= 12 + 3  # a read a page (and a shard's end)


async def test_a_whole_rules_retry_moves_at_most_its_chunk_a_call_and_steps_over_what_stays(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await retry_whole_rule(c, redis_client, namespace, 0, RANKS_AT_ONCE)


async def test_a_whole_rules_retry_at_a_rate_moves_a_quarter_seconds_worth_a_call(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await retry_whole_rule(c, redis_client, namespace, 200, 50)


async def retry_whole_rule(c: Coalescer, redis_client: Any, namespace: str, rate: int,
                           most: int) -> None:
    """A retry of every dead key of rule acct (1,200, a few stale) at ``rate``: no call
    reads more than ``most`` entries, every dead key comes back, the stale ones stay."""
    dead = [f"acct:{u % 7}:{u}" for u in range(1200)]
    await kill(redis_client, namespace, dead)
    space = KeySpace(namespace, 3)
    stale = dead[3::50]  # in the dead set, no state: stepped over, left there
    for key in stale:
        await redis_client.hdel(space.shard(space.shard_of(key)).meta, key)
    far = str(NOW_MS + 3_600_000)
    for shard in range(3):
        await redis_client.set(space.shard(shard).next_wake, far)
    calls: list[tuple[int, int]] = []  # (read, re-queued) by each call

    def seen(progress: BulkProgress) -> None:
        before = (sum(r for r, _ in calls), sum(d for _, d in calls))
        calls.append((progress.examined - before[0], progress.done - before[1]))

    done = await bulk(c, "retry", [], rate=rate, on_page=seen)
    assert (done.status, done.matched, done.done) == ("done", 1200, 1200 - len(stale))
    assert max(read for read, _ in calls) == most
    assert len(calls) >= 1200 // most
    left = [k for shard in range(3) for k in await redis_client.zrange(
        space.shard(shard).dead("acct"), 0, -1)]
    assert sorted(left) == sorted(stale)
    assert (await c.query.status())["rules"]["acct"]["pending"] == 1200 - len(stale)
    for shard in range(3):  # each shard's poller was woken for its keys
        assert int(await redis_client.get(space.shard(shard).next_wake)) < int(far)


async def test_a_whole_rules_retry_stopped_after_one_call_wakes_that_shards_poller(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await kill(redis_client, namespace, [f"acct:{u % 7}:{u}" for u in range(600)])
    space = KeySpace(namespace, 3)
    far = str(NOW_MS + 3_600_000)
    for shard in range(3):
        await redis_client.set(space.shard(shard).next_wake, far)

    def stop(progress: BulkProgress) -> None:
        progress.stop.set()

    done = await bulk(c, "retry", [], on_page=stop)  # --rate 0: no pause, no wake yet
    assert (done.status, done.done) == ("aborted", RANKS_AT_ONCE)
    assert int(await redis_client.get(space.shard(0).next_wake)) < int(far)
    assert await redis_client.get(space.shard(1).next_wake) == far  # not reached


async def test_a_dead_value_in_its_short_form_is_requeued(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await kill(redis_client, namespace, ["acct:1:1", "acct:1:2"])
    sk = KeySpace(namespace, 3).shard(KeySpace(namespace, 3).shard_of("acct:1:2"))
    await redis_client.hset(sk.meta, "acct:1:2", "D|1|1")  # no attempts, no error
    done = await bulk(c, "retry", [])
    assert (done.matched, done.done) == (2, 2)
    assert (await c.query.explain("acct:1:2"))["state"] == "pending"


async def test_a_whole_rules_retry_that_meets_a_redis_error_is_recorded_failed(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    await kill(redis_client, namespace, ["acct:1:1"])
    space = KeySpace(namespace, 3)
    broken = space.shard(0).dead("acct")
    await redis_client.delete(broken)
    await redis_client.set(broken, "not a sorted set")  # every read of it is refused
    search = make_filter(c.config, "acct", state="dead", where=[])
    progress = BulkProgress("retry", search, rate=0)

    with pytest.raises(Exception, match="WRONGTYPE"):
        await c.query.bulk(progress, await cancel_count(c))
    assert (progress.status, progress.done) == ("failed", 0)
    assert progress.error  # what failed, for the page and GET /bulk/{id}
    assert progress.ended is not None


async def test_an_action_that_fails_on_a_page_is_recorded_failed_and_stops(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    c.touch_many([f"acct:1:{u}" for u in range(5)])
    await c.flush()

    async def refused(keys: list[str]) -> int:
        raise RuntimeError("cancel refused")

    search = make_filter(c.config, "acct", state="pending", where=["org=1"])
    progress = BulkProgress("cancel", search, rate=0)
    with pytest.raises(RuntimeError, match="cancel refused"):
        await c.query.bulk(progress, refused)
    assert (progress.status, progress.done) == ("failed", 0)
    assert progress.error == "RuntimeError('cancel refused')"
    assert progress.ended is not None


def test_an_action_refuses_a_state_it_does_not_act_on() -> None:
    with pytest.raises(SearchError, match="retry acts on dead keys, not on --state pending"):
        action_state("retry", "pending")
    with pytest.raises(SearchError, match="cancel acts on pending or scheduled or paused"):
        action_state("cancel", "dead")
    with pytest.raises(SearchError, match="no bulk action 'delete'"):
        action_state("delete", None)
    assert (action_state("purge", None), action_state("run-now", None)) == ("dead", "pending")
