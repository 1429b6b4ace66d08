"""A key whose run ends while a reshard moves it to another shard, and a move that a
failover undoes: what the run wrote (a dead letter, a retry, a re-run for a touch
during it) ends in the key's new shard, nothing is left behind in the old one, and a
later touch refreshes it there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from coalescer import Coalescer
from coalescer.query.history import HistoryQuery
from coalescer.store.keys import KeySpace
from coalescer.store.layout import Layouts
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.replicated import ReplicatedRedis
from tests.helpers.servers import wait_until
from tests.worker.test_reshard import reshard_done, same_handler, server_ms, where

RULES = """\
namespace: {ns}
shards: 1
leader_lease: 1s
{durability}
rules:
  - name: jobs
    match: "jobs:{{id}}"
    window: {window}
    max_wait: {window}
    retry: {{attempts: {attempts}, backoff: {backoff}, max_backoff: {backoff}}}
    handler: {mod}:refresh
"""


def job_rules(tmp_path: Path, namespace: str, attempts: int, *, backoff: str = "10ms",
              durability: str = "", window: str = "100ms") -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"fin_{namespace}", RULES.format(
        ns=namespace, attempts=attempts, backoff=backoff, durability=durability,
        window=window, mod="{mod}"))


def moving_key(namespace: str) -> str:
    """A key of shard 0 of 1 whose shard of 4 is another."""
    return next(f"jobs:{i}" for i in range(100)
                if KeySpace(namespace, 4).shard_of(f"jobs:{i}") != 0)


def fail_until(gate: asyncio.Event) -> Callable[[Any], Awaitable[None]]:
    async def hook(claim: Any) -> None:
        await gate.wait()
        raise RuntimeError(f"no {claim.key}")
    return hook


async def passed_by_while_running(node: Coalescer, key: str) -> None:
    """Begin a reshard from 1 to 4 shards while ``key`` runs on ``node``, and wait until
    the node's mover has passed it by (a running key stays where it runs)."""
    layouts = node._run.layouts
    assert layouts is not None
    busy: list[tuple[str, ...]] = []
    take = layouts.take

    async def seen(*args: Any, **kw: Any) -> Any:
        taken = await take(*args, **kw)
        if taken is not None:
            busy.append(taken.running)
        return taken

    layouts.take = seen  # type: ignore[method-assign]
    assert await layouts.begin(4, "test")
    await layouts.raise_markers()
    await wait_until(lambda: (key,) in busy, message=f"the mover passing {key} by")


async def dead_keys(c: Coalescer) -> list[str]:
    return [e["key"] for e in (await c.query.dead_letters(limit=10)).entries]


async def refreshed_after_a_touch(c: Coalescer, rec: Recorder, key: str, runs: int) -> None:
    """Touch ``key`` with a handler that succeeds: it runs once more, its dead letter is
    gone and no state of it is left anywhere."""
    rec.hook = None
    c.touch(key)
    await c.flush()
    await wait_until(lambda: len(rec.succeeded) == 1 and len(rec.of(key)) == runs + 1,
                     message=f"{key} refreshed after the touch")
    assert await dead_keys(c) == []
    await wait_until(lambda: no_state(c.redis, c.config.namespace, key),
                     message=f"{key} done, in no shard")


async def no_state(r: Redis, namespace: str, key: str) -> bool:
    return await where(r, namespace, key, 4) == []


async def finish_while_moved(node: Coalescer, rec: Any, key: str, gate: asyncio.Event,
                             r: Redis) -> None:
    """Touch ``key``, let the reshard to 4 shards pass it by while it runs, then end its
    run (``gate``) and wait for the reshard to end."""
    node.touch(key)
    await node.flush()
    await wait_until(lambda: len(rec.of(key)) == 1, message="the key running")
    await passed_by_while_running(node, key)
    gate.set()
    await wait_until(lambda: reshard_done(r, node.config.namespace, 4), timeout=30,
                     message="the reshard to end")


async def test_a_key_that_fails_for_good_while_a_reshard_moves_it_is_dead_in_its_new_shard_only(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    path, rec = job_rules(tmp_path, namespace, attempts=1)
    key, gate = moving_key(namespace), asyncio.Event()
    rec.hook = fail_until(gate)
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        # its only try fails: dead-lettered in shard 0, which the layout left
        await finish_while_moved(a, rec, key, gate, redis_client)
        assert await dead_keys(a) == [key]
        assert await where(redis_client, namespace, key, 4) == [a.keyspace.shard_of(key)]
        await refreshed_after_a_touch(a, rec, key, runs=1)


async def test_a_key_whose_try_fails_while_a_reshard_moves_it_backs_off_in_its_new_shard(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    path, rec = job_rules(tmp_path, namespace, attempts=2, backoff="10m")
    key, gate = moving_key(namespace), asyncio.Event()
    rec.hook = fail_until(gate)
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        # its first try fails: its retry is queued in shard 0, which the layout left
        await finish_while_moved(a, rec, key, gate, redis_client)
        home = a.keyspace.shard_of(key)
        explained = await a.query.explain(key)
        assert (explained["state"], explained["attempts"], explained["shard"]) == (
            "backoff", 1, home)
        assert await where(redis_client, namespace, key, 4) == [home]
        rec.hook = None
        assert (await a.query.run_now([key])).states == {key: "hastened"}
        await wait_until(lambda: len(rec.succeeded) == 1, message="the retry")
        assert [c.attempt for c in rec.of(key)] == [1, 2]
        assert await dead_keys(a) == []
        await wait_until(lambda: no_state(redis_client, namespace, key),
                         message=f"{key} done, in no shard")


async def test_a_key_touched_during_a_run_a_reshard_moves_runs_again_in_its_new_shard(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    path, rec = job_rules(tmp_path, namespace, attempts=1)
    key, gate = moving_key(namespace), asyncio.Event()

    async def succeed_after_gate(claim: Any) -> None:
        if len(rec.of(key)) == 1:
            await gate.wait()

    rec.hook = succeed_after_gate
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        a.touch(key)
        await a.flush()
        await wait_until(lambda: len(rec.of(key)) == 1, message="the key running")
        await passed_by_while_running(a, key)
        before = await server_ms(redis_client)
        a.touch(key)  # while it runs: its old shard holds it, and keeps it for a re-run
        await a.flush()
        gate.set()  # the run succeeds: its re-run is queued in shard 0, which the layout left
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
        await wait_until(lambda: len(rec.succeeded) == 2, message="the re-run")
        assert rec.of(key)[1].last_touch_ms >= before  # the re-run covers that touch
        assert await dead_keys(a) == []
        await wait_until(lambda: no_state(redis_client, namespace, key),
                         message=f"{key} done, in no shard")
        history = await a.query.history(HistoryQuery(key=key))
        assert len(history) == 2


async def test_a_touch_by_the_old_layout_right_after_a_movers_scan_is_not_left_behind(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node that began a reshard has not raised the old shard's marker yet when a
    mover scans that shard, and a write path still on the old layout touches a key of
    another shard there just after the scan: the key ends in its new shard, never left
    in the old one once it is reported drained."""
    old, _ = job_rules(tmp_path, namespace, attempts=1, window="60s")
    new = same_handler(old, 4)
    key = moving_key(namespace)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        began = Layouts(writer._run.scripts, namespace, 1)  # type: ignore[arg-type]
        await began.refresh()
        assert await began.begin(4, "slow")  # its markers are not raised yet
        assert not writer.keyspace.resharding
        scan, touched = Layouts.scan, asyncio.Event()

        async def touch_behind(self: Layouts, *args: Any) -> tuple[int, list[str]]:
            found = await scan(self, *args)
            if not touched.is_set():
                touched.set()
                writer.touch(key)  # by the layout of 1 shard: to shard 0
                await writer.flush()
            return found

        monkeypatch.setattr(Layouts, "scan", touch_behind)
        async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
            await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                             message="the reshard to end")
        assert touched.is_set()
    assert await where(redis_client, namespace, key, 4) == [KeySpace(namespace, 4).shard_of(key)]


# -- a move the replica never got --------------------------------------------------------


@pytest.fixture
async def replicated(tmp_path: Path) -> AsyncIterator[tuple[ReplicatedRedis, Redis]]:
    """A primary and replica of their own, and a client that follows the primary."""
    servers = await asyncio.to_thread(ReplicatedRedis, tmp_path / "redis")
    r = redis.asyncio.Redis.from_url(
        servers.url, decode_responses=True, retry_on_error=[redis.ConnectionError],
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 10))
    try:
        yield servers, r
    finally:
        await r.aclose()
        await asyncio.to_thread(servers.stop)


@pytest.mark.slow  # a failover scenario: run apart, with the others (pytest -m slow)
async def test_a_dead_letter_moved_while_the_replica_lagged_moves_again_after_a_failover(
        replicated: tuple[ReplicatedRedis, Redis], namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica is cut off and a mover takes a dead letter out of its old shard on
    the primary; the primary then fails over before the mover's next step (its report
    that the shard is drained, or the step it tries again after an error) reaches Redis.
    The promoted replica holds the dead letter in the old shard still: the move it never
    confirmed must not count, and the key is moved again there, never left behind.

    The cut comes just before the mover's take of the key, once its raise of the shard's
    marker is confirmed: a durable step on a connection that wrote after the cut is never
    confirmed, so an earlier cut could hold the mover before it reaches the key."""
    servers, r = replicated
    old, rec = job_rules(tmp_path, namespace, attempts=1,
                         durability="durability: {replicas: 1, timeout: 250ms}")
    new = same_handler(old, 4)
    key, gate = moving_key(namespace), asyncio.Event()
    gate.set()
    rec.hook = fail_until(gate)
    async with Coalescer.from_yaml(old, redis_url=servers.url, worker=False) as writer:
        async with Coalescer.from_yaml(old, redis_url=servers.url, node_id="a"):
            writer.touch(key)
            await writer.flush()
            await wait_until(lambda: dead_in(writer, key), message=f"{key} dead-lettered")
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "test")
        await layouts.raise_markers()
        await r.set(f"{namespace}:probe", 1)  # the replica holds all of that
        assert await r.wait(1, 5000) == 1

        reporting, failed_over = asyncio.Event(), asyncio.Event()
        drained = Layouts.drained

        async def after_the_failover(self: Layouts, gen: int, shard: int, moved: int) -> bool:
            reporting.set()
            await failed_over.wait()
            return await drained(self, gen, shard, moved)

        take, cut = Layouts.take, asyncio.Event()

        async def cut_first(self: Layouts, shard: Any, gen: int, keys: Any,
                            *args: Any, **kw: Any) -> Any:
            if key in keys and not cut.is_set():
                cut.set()
                await asyncio.to_thread(servers.cut_replica)
            return await take(self, shard, gen, keys, *args, **kw)

        monkeypatch.setattr(Layouts, "drained", after_the_failover)
        monkeypatch.setattr(Layouts, "take", cut_first)
        shard0 = KeySpace(namespace, 1).shard(0)
        async with Coalescer.from_yaml(new, redis_url=servers.url, node_id="b") as b:
            await wait_until(lambda: gone(r, shard0.meta, key), timeout=20,
                             message=f"the mover taking {key} out of shard 0")
            errors = b.metrics.registry.get_sample_value
            await wait_until(lambda: reporting.is_set()
                             or bool(errors("coalescer_redis_errors_total", {"loop": "mover"})),
                             timeout=20, message="the mover's next step")
            await asyncio.to_thread(servers.fail_over)
            failed_over.set()
            await wait_until(lambda: reshard_done(r, namespace, 4), timeout=30,
                             message="the reshard to end")
            assert await dead_keys(b) == [key]
            assert await where(r, namespace, key, 4) == [b.keyspace.shard_of(key)]
            await refreshed_after_a_touch(b, rec, key, runs=1)


async def dead_in(c: Coalescer, key: str) -> bool:
    return await dead_keys(c) == [key]


async def gone(r: Redis, meta: str, key: str) -> bool:
    return not await r.hexists(meta, key)
