"""Cancel, in process, on a real valkey-server: what it drops and what it leaves.

A pending key is never refreshed once cancelled; a running key's refresh finishes but
the re-run its earlier touches queued is dropped, while a touch after the cancel arms
it again; touches still buffered in this process are dropped too; keys that are not
pending are named, each with the state it was found in.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import RedisError

from coalescer import (
    CancelOutcome,
    Claim,
    ClosedError,
    Coalescer,
    InvalidKeyError,
    SyncCoalescer,
    UnknownKeyError,
)
from coalescer.query.history import HistoryQuery
from coalescer.store.keys import KeySpace
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules, server_ms, settled
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 100ms
  max_wait: 2s
  absorb: 10ms
  timeout: 5s
  retry: {{attempts: 2, backoff: {backoff}, max_backoff: {backoff}}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
  - name: other
    match: "other:{{id}}"
    handler: {{mod}}:refresh
  - name: bag
    match: "bag:{{id}}"
    items: {{max: 10}}
    handler: {{mod}}:refresh
"""



def setup(tmp_path: Path, namespace: str, *, shards: int = 1,
          backoff: str = "20ms") -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"cancel_{namespace}",
                          RULES.format(ns=namespace, shards=shards, backoff=backoff))


def keys_of(calls: list[Claim]) -> list[str]:
    return [claim.key for claim in calls]


async def cancelled_entries(c: Coalescer, key: str) -> list[Any]:
    return [r for r in await c.query.history(HistoryQuery(key=key)) if r.outcome == "cancelled"]


# -- pending keys ---------------------------------------------------------------------------


async def test_a_cancelled_pending_key_is_never_refreshed_and_the_history_says_so(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False, node_id="canceller")
    c.touch_many(["item:1", "item:2", "other:1"])
    await c.flush()
    before = await server_ms(redis_client)

    outcome = await c.cancel_many(["item:1", "other:1"])

    assert outcome == CancelOutcome(["item:1", "other:1"], [],
                                    {"item:1": "pending", "other:1": "pending"})
    assert outcome.done == 2
    assert keys_of(await c.drain(timeout=10)) == ["item:2"]
    assert keys_of(rec.calls) == ["item:2"]
    [entry] = await cancelled_entries(c, "item:1")
    assert (entry.key, entry.rule, entry.node, entry.duration_ms) == (
        "item:1", "item", "canceller", 0)
    assert entry.start_ms >= before
    assert entry.due_ms is not None and entry.due_ms > before  # the due time it dropped
    info = await c.query.explain("item:1")
    assert info["state"] == "idle"
    assert info["last_refreshes"][0]["outcome"] == "cancelled"
    status = await c.query.status()
    assert status["rules"]["item"]["pending"] == 0
    assert status["rules"]["item"]["recent"] == {"refreshes": 1, "failed": 0}  # not the cancel
    assert c.metrics.cancels.labels("item")._value.get() == 1
    assert c.metrics.cancels.labels("other")._value.get() == 1


async def test_a_cancel_drops_the_items_touched_before_it(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    shard = KeySpace(namespace, 1).shard(0)
    c.touch("bag:1", "row-1")
    c.touch("bag:1", "row-2")
    await c.flush()
    assert await redis_client.scard(shard.items("bag:1")) == 2

    outcome = await c.cancel("bag:1")

    assert outcome.states == {"bag:1": "pending"}
    assert await redis_client.exists(shard.items("bag:1"), shard.claimed_items("bag:1")) == 0
    c.touch("bag:1", "row-3")
    await c.flush()
    [claim] = await c.drain(timeout=10)
    assert (claim.key, claim.items, claim.items_overflowed) == ("bag:1", ("row-3",), False)


async def test_a_touch_after_a_cancel_arms_the_key_again(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch("item:1")
    await c.flush()
    await c.cancel("item:1")
    after = await server_ms(redis_client)
    c.touch("item:1")
    await c.flush()

    [claim] = await c.drain(timeout=10)
    assert claim.key == "item:1"
    assert claim.first_touch_ms >= after  # a new burst: the cancelled one is gone


async def test_a_cancel_drops_a_retry_in_backoff_with_its_attempts(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, backoff="30s")

    async def fail_first(claim: Claim) -> None:
        if len(rec.calls) == 1:
            raise RuntimeError("first try fails")

    rec.hook = fail_first
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("item:1")
    await c.flush()
    await wait_until(lambda: _state_is(c, "item:1", "backoff"), message="item:1 in backoff")

    outcome = await c.cancel("item:1")

    assert outcome.states == {"item:1": "pending"}
    assert (await c.query.explain("item:1"))["state"] == "idle"
    c.touch("item:1")
    await c.flush()
    await wait_until(lambda: settled(redis_client, namespace), message="item:1 refreshed")
    assert [claim.attempt for claim in rec.calls] == [1, 1]  # fresh attempts


async def _state_is(c: Coalescer, key: str, state: str) -> bool:
    return bool((await c.query.explain(key))["state"] == state)


# -- running keys ---------------------------------------------------------------------------


async def first_run_held(start: Start, path: Path, rec: Recorder,
                         redis_url: str) -> tuple[Coalescer, asyncio.Event]:
    """A node running item:1's first refresh, held until the returned gate is set."""
    gate = rec.hold_first()
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("item:1")
    await c.flush()
    await wait_until(lambda: len(rec.calls) == 1, message="the refresh running")
    return c, gate


async def test_a_running_refresh_finishes_but_its_earlier_touches_re_arm_nothing(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c, gate = await first_run_held(start, path, rec, redis_url)
    c.touch("item:1")  # during the run: queues a re-run
    await c.flush()
    assert (await c.query.explain("item:1"))["running"]["touched_again"] is not None

    outcome = await c.cancel("item:1")

    assert outcome == CancelOutcome(["item:1"], [], {"item:1": "rearm"})
    info = await c.query.explain("item:1")
    assert info["state"] == "running"
    assert info["running"]["touched_again"] is None
    gate.set()
    await wait_until(lambda: settled(redis_client, namespace), message="the run acked")
    assert len(rec.calls) == 1
    assert len(rec.succeeded) == 1  # the running refresh finished, and was acked
    assert len(await cancelled_entries(c, "item:1")) == 1


async def test_a_touch_after_the_cancel_of_a_running_key_refreshes_it_again(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c, gate = await first_run_held(start, path, rec, redis_url)
    c.touch("item:1")
    await c.flush()
    await c.cancel("item:1")
    after = await server_ms(redis_client)
    c.touch("item:1")
    await c.flush()
    gate.set()
    await wait_until(lambda: settled(redis_client, namespace), message="every run acked")

    assert len(rec.calls) == 2
    assert rec.calls[1].first_touch_ms >= after  # only the touch after the cancel


async def test_a_running_key_with_nothing_queued_is_not_pending_and_runs_on(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c, gate = await first_run_held(start, path, rec, redis_url)

    outcome = await c.cancel("item:1")

    assert outcome == CancelOutcome([], ["item:1"], {"item:1": "running"})
    assert await cancelled_entries(c, "item:1") == []
    gate.set()
    await wait_until(lambda: settled(redis_client, namespace), message="the run acked")
    assert len(rec.succeeded) == 1
    assert c.metrics.cancels.labels("item")._value.get() == 0


# -- touches still in this process's buffer ----------------------------------------------------


async def test_touches_still_buffered_are_dropped(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch_many(["item:1", "item:2"])  # not flushed: both wait in the buffer

    outcome = await c.cancel("item:1")

    assert outcome == CancelOutcome(["item:1"], [], {"item:1": "buffered"})
    await c.flush()
    assert keys_of(await c.drain(timeout=10)) == ["item:2"]
    assert keys_of(rec.calls) == ["item:2"]


async def test_touches_being_written_when_the_cancel_comes_are_cancelled_too(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    sk = KeySpace(namespace, 1).shard(0)
    cancelled = 0
    for i in range(20):
        key = f"item:{i}"
        c.touch(key)
        for _ in range(i % 4):
            await asyncio.sleep(0)  # the write may be taken, in flight or done
        outcome = await c.cancel(key)
        cancelled += outcome.done
        assert await redis_client.zscore(sk.due("item"), key) is None, outcome
    await c.flush()
    assert cancelled == 20
    assert await c.drain(timeout=10) == []
    assert rec.calls == []


async def test_more_keys_than_one_script_call_takes_of_two_rules_are_all_cancelled(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace, shards=2)
    c = await start(path, redis_url=redis_url, worker=False)
    keys = [f"{rule}:{n}" for n in range(700) for rule in ("item", "other")]
    c.touch_many(keys)
    await c.flush()

    outcome = await c.cancel_many([*keys, "item:0"])  # a key named twice counts once

    assert outcome.cancelled == keys
    rules = (await c.query.status())["rules"]
    assert (rules["item"]["pending"], rules["other"]["pending"]) == (0, 0)
    assert await c.drain(timeout=10) == []


async def test_a_cancel_while_redis_is_down_raises_and_drops_the_touches_a_failed_write_gave_back(
        own_server: ValkeyProcess, tmp_path: Path, namespace: str, start: Start) -> None:
    server = own_server  # requested first: it outlives the coalescer
    try:
        path, _ = setup(tmp_path, namespace)
        c = await start(path, redis_url=server.url, worker=False)
        server.kill()
        c.touch("item:1")
        errors = c.metrics.redis_errors.labels("flusher")
        await wait_until(lambda: errors._value.get() > 0, message="a write of item:1 failed")

        with pytest.raises((RedisError, OSError)):
            await c.cancel("item:1")

        server.start()
        await wait_until(c.ping, timeout=10, message="reconnected")
        await c.flush()
        assert (await c.query.explain("item:1"))["state"] == "idle"  # never written
    finally:
        server.start()


# -- keys that are not pending, refused keys --------------------------------------------------


async def test_idle_and_dead_keys_are_not_pending_and_are_left_alone(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace)

    async def fail(claim: Claim) -> None:
        if claim.key == "item:dead":
            raise RuntimeError("always")

    rec.hook = fail
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch_many(["item:dead", "item:1"])
    await c.drain(timeout=10)  # item:dead fails twice: dead-lettered
    c.touch("item:2")
    await c.flush()

    outcome = await c.cancel_many(["item:dead", "item:1", "item:2", "item:never"])

    assert outcome == CancelOutcome(
        ["item:2"], ["item:dead", "item:1", "item:never"],
        {"item:dead": "dead", "item:1": "idle", "item:2": "pending", "item:never": "idle"})
    page = await c.query.dead_letters(["item:dead"])
    assert [d["key"] for d in page.entries] == ["item:dead"]  # dead purge deletes it, not this
    assert outcome.to_json() == {"cancelled": outcome.cancelled,
                                 "not_pending": outcome.not_pending, "states": outcome.states}


async def test_a_key_no_rule_matches_or_redis_cannot_store_cancels_nothing(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace)
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch("item:1")
    await c.flush()

    with pytest.raises(UnknownKeyError):
        await c.cancel_many(["item:1", "nope:1"])
    with pytest.raises(InvalidKeyError):
        await c.cancel_many(["item:1", "item:\0"])

    assert (await c.query.explain("item:1"))["state"] == "pending"


async def test_cancel_on_a_coalescer_that_is_not_running_raises(tmp_path: Path,
                                                                 namespace: str) -> None:
    path, _ = setup(tmp_path, namespace)
    c = Coalescer.from_yaml(path, worker=False)
    with pytest.raises(ClosedError, match="not started"):
        await c.cancel("item:1")


# -- the sync façade, a cluster --------------------------------------------------------------


async def test_sync_coalescer_cancels(tmp_path: Path, namespace: str, redis_url: str,
                                      redis_client: Any) -> None:
    path, _ = setup(tmp_path, namespace)

    def run() -> tuple[CancelOutcome, CancelOutcome]:
        with SyncCoalescer.from_yaml(path, redis_url=redis_url) as sync:
            sync.touch("item:1")
            sync.flush()
            return sync.cancel("item:1"), sync.cancel_many(["item:1", "item:2"])

    first, second = await asyncio.to_thread(run)
    assert first.states == {"item:1": "pending"}
    assert second == CancelOutcome([], ["item:1", "item:2"], {"item:1": "idle", "item:2": "idle"})


async def test_cancel_on_a_cluster_groups_keys_by_shard(
        cluster: Any, tmp_path: Path, namespace: str) -> None:
    path, rec = setup(tmp_path, namespace, shards=6)
    async with Coalescer.from_yaml(path, redis_url=cluster.urls[0], worker=False) as c:
        keys = [f"item:{n}" for n in range(30)]
        c.touch_many(keys)
        await c.flush()
        shards = {c.keyspace.shard_of(key) for key in keys}
        assert len(shards) == 6

        outcome = await c.cancel_many(keys[:20])

        assert outcome.cancelled == keys[:20]
        assert set(keys_of(await c.drain(timeout=20))) == set(keys[20:])
        assert sorted(keys_of(rec.calls)) == sorted(keys[20:])
