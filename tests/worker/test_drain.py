"""``await coalescer.drain()``: everything pending runs now, here, windows skipped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coalescer import Claim, ClosedError, Coalescer
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from coalescer.store.scripts import Scripts
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules, settled

# Default settings (window 2s, concurrency 16, 5 attempts) beside a rule whose window
# is an hour: a drain that waited for either would time out.
RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: user
    match: "stats:user:{{id}}"
    handler: {{mod}}:refresh
  - name: org
    match: "stats:org:{{id}}"
    window: 1h
    max_wait: 2h
    concurrency: {concurrency}
    retry: {{attempts: 3, backoff: 1h, max_backoff: 1h}}
    handler: {{mod}}:refresh
"""



def rules(ns: str, shards: int = 1, concurrency: int = 16) -> str:
    return RULES.format(ns=ns, shards=shards, concurrency=concurrency)


def setup(tmp_path: Path, namespace: str, text: str) -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"drain_{namespace}", text)


@pytest.mark.parametrize("case", [(False, 1), (False, 4), (True, 1), (True, 4)],
                         ids=["write-only-1-shard", "write-only-4-shards", "worker-1-shard",
                              "worker-4-shards"])
async def test_drain_runs_every_pending_key_once_now_and_returns_the_claims(
        tmp_path: Path, namespace: str, redis_url: str, start: Start,
        case: tuple[bool, int]) -> None:
    worker, shards = case
    path, rec = setup(tmp_path, namespace, rules(namespace, shards))
    c = await start(path, redis_url=redis_url, worker=worker)
    keys = ["stats:user:1", "stats:org:7", "stats:user:2", "stats:org:\u00e9|\n x"]
    for key in keys * 3:
        c.touch(key)

    claims = await c.drain(timeout=20)

    assert sorted(cl.key for cl in claims) == sorted(keys)
    assert claims == rec.calls  # the handlers ran each of them, in this order
    assert all(isinstance(cl, Claim) and cl.attempt == 1 for cl in claims)
    assert {cl.key: cl.params for cl in claims}["stats:org:7"] == {"id": "7"}
    status = await c.query.status()
    assert {n: (r["pending"], r["in_flight"]) for n, r in status["rules"].items()} == {
        "user": (0, 0), "org": (0, 0)}
    assert await settled(c.redis, namespace, shards)  # no state left at all
    assert await c.drain(timeout=5) == []  # nothing left: an empty drain


async def test_touches_made_by_handlers_are_drained_too_in_run_order(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules(namespace))
    c = await start(path, redis_url=redis_url, worker=False)

    async def cascade(claim: Claim) -> None:
        if claim.rule == "user":  # a user's refresh makes its org stale
            c.touch(f"stats:org:of-{claim.params['id']}")

    rec.hook = cascade
    c.touch("stats:user:1")
    claims = await c.drain(timeout=20)
    assert [cl.key for cl in claims] == ["stats:user:1", "stats:org:of-1"]


async def test_a_failing_handler_is_retried_at_once_until_dead(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules(namespace))
    c = await start(path, redis_url=redis_url, worker=True)

    async def fail(claim: Claim) -> None:
        if claim.key == "stats:org:bad":
            raise RuntimeError("no such org")

    rec.hook = fail
    c.touch_many(["stats:org:bad", "stats:org:good"])
    claims = await c.drain(timeout=20)  # backoff is an hour: skipped as well
    assert [cl.attempt for cl in claims if cl.key == "stats:org:bad"] == [1, 2, 3]
    assert [cl.key for cl in claims].count("stats:org:good") == 1
    page = await c.query.dead_letters()
    assert [d["key"] for d in page.entries] == ["stats:org:bad"]
    assert "no such org" in page.entries[0]["error"]


async def test_concurrency_one_drains_many_keys_one_at_a_time(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules(namespace, concurrency=1))
    c = await start(path, redis_url=redis_url, worker=False)
    running: list[str] = []
    most = 0

    async def overlap(claim: Claim) -> None:
        nonlocal most
        running.append(claim.key)
        most = max(most, len(running))
        await asyncio.sleep(0)
        running.remove(claim.key)

    rec.hook = overlap
    keys = [f"stats:org:{i}" for i in range(40)]
    c.touch_many(keys)
    claims = await c.drain(timeout=30)
    assert sorted(cl.key for cl in claims) == sorted(keys)
    assert most == 1


async def test_drain_times_out_naming_what_is_left(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules(namespace, concurrency=1))
    c = await start(path, redis_url=redis_url, worker=False)
    release = asyncio.Event()

    async def stuck(claim: Claim) -> None:
        await release.wait()

    rec.hook = stuck
    c.touch_many(["stats:org:a", "stats:org:b"])
    with pytest.raises(TimeoutError) as caught:
        await c.drain(timeout=0.5)
    message = str(caught.value)
    running = rec.calls[0].key
    waiting = ({"stats:org:a", "stats:org:b"} - {running}).pop()
    assert f"still pending: {waiting!r}" in message
    assert f"still in flight: {running!r}" in message
    assert "0.5s" in message


async def test_drain_waits_for_a_key_another_node_is_running(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules(namespace))
    other = await start(path, redis_url=redis_url, worker=True, node_id="other")
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(claim: Claim) -> None:
        started.set()
        await release.wait()

    rec.hook = slow
    other.touch("stats:user:1")
    drainer = await start(path, redis_url=redis_url, worker=False, node_id="drainer")
    other_drain = asyncio.create_task(other.drain(timeout=20))
    await started.wait()
    with pytest.raises(TimeoutError, match=r"still in flight: 'stats:user:1'"):
        await drainer.drain(timeout=0.3)  # held by "other": waited for
    release.set()
    assert await drainer.drain(timeout=20) == []  # it ran elsewhere: not this process's
    assert [cl.key for cl in await other_drain] == ["stats:user:1"]


async def test_drain_on_a_coalescer_not_started_says_to_start_it(tmp_path: Path,
                                                                 namespace: str) -> None:
    path, _ = setup(tmp_path, namespace, rules(namespace))
    with pytest.raises(ClosedError, match=r"drain\(\): the coalescer is not started"):
        await Coalescer.from_yaml(path, worker=False).drain()


async def test_hasten_makes_pending_keys_due_now_and_leaves_running_ones(
        redis_client: Any, redis_url: str, namespace: str) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        scripts = Scripts(client)
        sk = KeySpace(namespace, 1).shard(0)
        from coalescer.store.script_types import UpsertGroup
        hour = 3_600_000
        await scripts.upsert(sk, [UpsertGroup("org", hour, 2 * hour, ["a", "b", "c"])])
        await redis_client.hset(sk.meta, "c", "R|9|1|1|1|1||||n")  # running: left alone
        await redis_client.zrem(sk.due("org"), "c")
        await redis_client.zadd(sk.inflight("org"), {"c": 1})
        done = await scripts.hasten(sk, ["org"], 1000)
        assert (done.hastened, done.pending, done.in_flight) == (2, 2, 1)
        for key in ("a", "b"):
            assert await redis_client.zscore(sk.due("org"), key) == done.now_ms
            state = states.pending(await redis_client.hget(sk.meta, key))
            assert state is not None and state.due_ms == done.now_ms
        assert await redis_client.hget(sk.meta, "c") == "R|9|1|1|1|1||||n"
        again = await scripts.hasten(sk, ["org"], 1000)
        assert again.hastened == 0  # already due: left as they are
    finally:
        await client.aclose()
