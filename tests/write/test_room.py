"""Writers that wait for room: ``touch_wait`` and ``touch_many_wait``, blocking (threads,
``SyncCoalescer``) and awaitable (``Coalescer``), against a real server of the test's own.

The buffer is kept full for certain by pausing the server's writes (``CLIENT PAUSE
WRITE``): the flusher's scripts wait, so no key leaves the buffer until the test
unpauses it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis

from coalescer import BackpressureError, ClosedError, Coalescer, SyncCoalescer, UnknownKeyError
from tests.helpers.servers import ValkeyProcess, poll_until, wait_until

RULES = """\
namespace: {ns}
shards: 2
defaults:
  window: 1m
  max_wait: 5m
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:print
"""

Make = Callable[..., Awaitable[Coalescer]]


@pytest.fixture
def rules(rules_file: Callable[..., Path], namespace: str) -> Path:
    return rules_file(RULES.format(ns=namespace))


@pytest_asyncio.fixture
async def make(rules: Path, own_server: ValkeyProcess) -> AsyncIterator[Make]:
    started: list[Coalescer] = []

    async def build(**options: Any) -> Coalescer:
        c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False, **options)
        await c.start()
        started.append(c)
        return c

    yield build
    for c in started:
        await c.close()


@pytest.fixture
def admin(own_server: ValkeyProcess) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(own_server.url, decode_responses=True)
    yield client
    client.client_unpause()
    client.close()


def pause_writes(admin: redis.Redis) -> None:
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")


def stored(admin: redis.Redis, namespace: str) -> set[str]:
    """Every key pending in Redis, over both shards."""
    found: set[str] = set()
    for shard in (0, 1):
        found |= set(admin.zrange(f"{namespace}:{{{namespace}:{shard}}}:due:stats", 0, -1))
    return found


def test_sixteen_threads_waiting_for_room_lose_nothing_and_never_see_backpressure(
        rules: Path, own_server: ValkeyProcess, admin: redis.Redis, namespace: str) -> None:
    per_thread = 1000
    errors: list[BaseException] = []
    with SyncCoalescer.from_yaml(rules, redis_url=own_server.url, max_buffered=200) as c:
        pause_writes(admin)  # the buffer fills for sure, and the writers wait
        go = threading.Barrier(17)

        def write(n: int) -> None:
            go.wait()
            try:
                for i in range(per_thread):
                    c.touch_wait(f"stats:{n}-{i}", timeout=60)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        go.wait()
        poll = c.coalescer
        poll_until(lambda: poll._run.absorber.waits >= 16, message="every writer waiting")
        with pytest.raises(BackpressureError, match="already buffered"):
            c.touch("stats:never")  # the raising touch still raises
        admin.client_unpause()
        for t in threads:
            t.join()
        c.flush()
        c.coalescer.sync_metrics()
        waits = c.coalescer.metrics.registry.get_sample_value("coalescer_touch_waits_total")
    assert errors == []
    assert stored(admin, namespace) == {f"stats:{n}-{i}" for n in range(16)
                                        for i in range(per_thread)}
    assert waits is not None and waits >= 16


def test_a_waiting_touch_times_out_with_a_clear_error(
        rules: Path, own_server: ValkeyProcess, admin: redis.Redis, namespace: str) -> None:
    with SyncCoalescer.from_yaml(rules, redis_url=own_server.url, max_buffered=10) as c:
        pause_writes(admin)
        keys = [f"stats:{i}" for i in range(10)]
        c.touch_many_wait(keys, timeout=5)  # room for all ten
        with pytest.raises(BackpressureError) as info:
            c.touch_wait("stats:late", timeout=0.05)
        assert str(info.value) == (
            "touch_wait('stats:late') refused after waiting 0.05s for room: 10 keys are "
            "buffered and not yet written to Redis (is Redis reachable, or keeping up?)")
        with pytest.raises(BackpressureError, match=r"touch_many_wait\(\): 0 of 5 keys "
                                                    r"buffered, the other 5 refused after "
                                                    r"waiting 0s"):
            c.touch_many_wait([f"stats:new{i}" for i in range(5)], timeout=0)
        with pytest.raises(ValueError, match="timeout must be"):
            c.touch_wait("stats:x", timeout=-1)
        admin.client_unpause()
        c.flush()
    assert stored(admin, namespace) == set(keys)


def test_a_refused_key_in_touch_many_wait_buffers_nothing(
        rules: Path, own_server: ValkeyProcess, admin: redis.Redis, namespace: str) -> None:
    with SyncCoalescer.from_yaml(rules, redis_url=own_server.url, max_buffered=10) as c:
        with pytest.raises(UnknownKeyError):
            c.touch_many_wait(["stats:1", "other:2"])
        c.flush()
    assert stored(admin, namespace) == set()


async def test_async_writers_wait_for_room_without_blocking_the_loop(
        make: Make, admin: redis.Redis, namespace: str) -> None:
    c = await make(max_buffered=50)
    pause_writes(admin)
    keys = [f"stats:{i}" for i in range(400)]
    bulk = asyncio.create_task(c.touch_many_wait(keys, timeout=60))
    single = asyncio.create_task(c.touch_wait("stats:one", timeout=60))
    await wait_until(lambda: c._run.absorber.waits >= 2, message="both writers waiting")
    assert not bulk.done() and not single.done()
    with pytest.raises(BackpressureError):
        c.touch("stats:refused")
    await asyncio.to_thread(admin.client_unpause)
    await asyncio.gather(bulk, single)
    await c.flush()
    assert stored(admin, namespace) == {*keys, "stats:one"}
    pause_writes(admin)
    c.touch_many([f"stats:fill{i}" for i in range(50)])
    with pytest.raises(BackpressureError, match="after waiting 0s"):
        await c.touch_wait("stats:late", timeout=0)
    admin.client_unpause()


async def test_blocking_the_event_loop_thread_is_refused(make: Make) -> None:
    c = await make(max_buffered=50)
    with pytest.raises(RuntimeError, match="would block the event loop"):
        c.touch_blocking(["stats:1"], timeout=1)


async def test_close_ends_touches_waiting_for_room(make: Make, admin: redis.Redis) -> None:
    c = await make(max_buffered=5)
    pause_writes(admin)
    c.touch_many([f"stats:{i}" for i in range(5)])
    waiting = asyncio.create_task(c.touch_wait("stats:late", timeout=60))
    await wait_until(lambda: c._run.absorber.waits >= 1, message="the writer waiting")
    closing = asyncio.create_task(c.close())
    with pytest.raises(ClosedError, match="closing"):
        await waiting
    await asyncio.to_thread(admin.client_unpause)
    await closing


def test_a_timed_out_touch_many_wait_keeps_the_keys_it_buffered(
        rules: Path, own_server: ValkeyProcess, admin: redis.Redis, namespace: str) -> None:
    with SyncCoalescer.from_yaml(rules, redis_url=own_server.url, max_buffered=10) as c:
        pause_writes(admin)
        first = [f"stats:{i}" for i in range(8)]
        c.touch_many_wait(first)
        more = [f"stats:more{i}" for i in range(5)]
        with pytest.raises(BackpressureError, match=r"2 of 5 keys buffered, the other 3 "
                                                    r"refused after waiting 0.1s"):
            c.touch_many_wait(more, timeout=0.1)
        admin.client_unpause()
        c.flush()
    assert stored(admin, namespace) == {*first, *more[:2]}
