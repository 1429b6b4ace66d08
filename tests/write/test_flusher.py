"""The write path: ``Coalescer(worker=False)`` touch → absorber → flusher → Redis.

Costs are counted on the server (``INFO commandstats``) of a server of the test's
own, so nothing else talks to it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from coalescer import BackpressureError, ClosedError, Coalescer, UnknownKeyError
from coalescer.errors import RedisUnreachableError
from coalescer.store import key_states as states
from coalescer.store.keys import layout, protocol_version
from coalescer.store.script_calls import SCRIPT_NAMES, script_source
from coalescer.store.write_scripts import WriteScripts
from coalescer.write import quota
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
defaults:
  window: 10s
  max_wait: 1m
  absorb: {absorb}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:print
"""
WINDOW_MS = 10_000

Make = Callable[..., Awaitable[Coalescer]]


@pytest_asyncio.fixture
async def make(rules_file: Callable[..., Any], namespace: str) -> AsyncIterator[Make]:
    """make(url, absorb="50ms", shards=1, **options): a started write-path coalescer."""
    started: list[Coalescer] = []

    async def build(url: str, *, absorb: str = "50ms", shards: int = 1,
                    **options: Any) -> Coalescer:
        path = rules_file(RULES.format(ns=namespace, shards=shards, absorb=absorb))
        c = Coalescer.from_yaml(path, redis_url=url, worker=False, **options)
        await c.start()
        started.append(c)
        return c

    yield build
    for c in started:
        await c.close()


@pytest.fixture
def no_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pending-key counts of the nodes made next wait an hour between two: a test
    that counts the server's commands counts the touches' alone (a count runs a script,
    HSCAN and MEMORY USAGE about once a second while touches come)."""
    monkeypatch.setattr(quota, "EVERY", 3600.0)


async def server_ms(client: Any) -> int:
    sec, usec = await client.time()
    return int(sec) * 1000 + int(usec) // 1000


async def command_calls(client: Any) -> dict[str, int]:
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


# commandstats also counts the commands a script runs inside the server; these are the
# ones our scripts run, so every other command there was sent by a client.
IN_SCRIPTS = {name.lower() for src in map(script_source, SCRIPT_NAMES)
              for name in re.findall(r"redis\.call\(\s*'(\w+)'", src)}


def delta(before: dict[str, int], after: dict[str, int], *names: str) -> int:
    keys = names or tuple(after)
    return sum(after.get(k, 0) - before.get(k, 0) for k in keys)


def client_commands(before: dict[str, int], after: dict[str, int]) -> int:
    """Commands clients sent between the two readings, less the INFO that read ``before``."""
    assert {"hset", "zadd"} <= IN_SCRIPTS
    return delta(before, after, *(set(after) - IN_SCRIPTS)) - 1


async def counted_flush(c: Coalescer, n: int) -> tuple[dict[str, int], dict[str, int]]:
    """The server's command counts before and after a flush of ``n`` fresh keys
    (``stats:0``, ...), the script loaded and the connection open before."""
    c.touch("stats:warm")
    await c.flush()
    before = await command_calls(c.redis)
    for i in range(n):
        c.touch(f"stats:{i}")
    await c.flush()
    return before, await command_calls(c.redis)


@pytest.fixture
def upsert_sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each upsert call's size as the flusher makes it, (keys, keys and items), recorded
    at the script call (a count of the server's script calls would also count any
    other script that runs meanwhile)."""
    sizes: list[tuple[int, int]] = []
    upsert = WriteScripts.upsert_keys

    async def recorded(self: WriteScripts, shard: Any, groups: Any, *args: Any) -> Any:
        keys = sum(len(g.keys) for g in groups)
        items = sum(len(v) for g in groups for v in (g.items or {}).values())
        sizes.append((keys, keys + items))
        return await upsert(self, shard, groups, *args)
    monkeypatch.setattr(WriteScripts, "upsert_keys", recorded)
    return sizes


def buffered(c: Coalescer) -> float | None:
    return c.metrics.registry.get_sample_value("coalescer_buffered_keys")


async def test_flush_returns_once_redis_holds_the_due_times(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis) -> None:
    c = await make(redis_url)
    due_key = c.keyspace.shard(0).due("stats")
    before = await server_ms(redis_client)
    for key in ("stats:1", "stats:2", "stats:1"):
        c.touch(key)
    await c.flush()
    scores = {k: await redis_client.zscore(due_key, k) for k in ("stats:1", "stats:2")}
    after = await server_ms(redis_client)
    for key, score in scores.items():
        assert score is not None, f"{key} not in Redis after flush()"
        assert before + WINDOW_MS <= score <= after + WINDOW_MS


# What one upsert call of new plain keys runs inside Redis, as before items existed
# (one GET reads the shard's layout marker, one the poller's next wake-up).
# one call per shard: its new keys' bytes added to the shard's count with one HINCRBY
PLAIN_UPSERT = {"evalsha": 1, "time": 1, "hmget": 1, "hset": 1, "zadd": 1, "get": 2,
                "hincrby": 1, "hget": 1}  # hget: whether the rule is fair (it is not)


@pytest.mark.usefixtures("no_counts")
async def test_plain_touches_cost_what_they_did_before_items_existed(
        make: Make, own_server: ValkeyProcess) -> None:
    """The items path is separate: a flush of plain touches sends no items section and
    runs no set command, and its commands are the same, call for call."""
    before, after = await counted_flush(await make(own_server.url), 100)
    ran = {name: n for name in after if (n := delta(before, after, name))}
    ran["info"] -= 1  # the INFO that read ``before``
    assert {k: v for k, v in ran.items() if v} == PLAIN_UPSERT


@pytest.mark.usefixtures("no_counts")
async def test_a_hot_key_costs_at_most_one_upsert_per_absorb_interval(
        make: Make, own_server: ValkeyProcess) -> None:
    absorb = 0.02
    c = await make(own_server.url, absorb="20ms")
    touches = 100_000
    before = await command_calls(c.redis)
    start = time.monotonic()
    for i in range(touches):
        c.touch("stats:hot")
        if i % 10 == 0:
            await asyncio.sleep(0)  # give the flusher every chance to write
    await c.flush()
    elapsed = time.monotonic() - start
    after = await command_calls(c.redis)

    upserts = delta(before, after, "evalsha", "eval")
    assert upserts >= 1
    # one write per absorb interval, + the first, + flush(), + a NOSCRIPT retry, + slack
    assert upserts <= elapsed / absorb + 4, (upserts, elapsed)
    assert upserts * 100 < touches
    assert await c.redis.zscore(c.keyspace.shard(0).due("stats"), "stats:hot") is not None
    await c.flush()  # counters catch up
    assert c.metrics.registry.get_sample_value("coalescer_touches_total") == touches
    absorbed = c.metrics.registry.get_sample_value("coalescer_absorbed_touches_total")
    assert absorbed is not None and absorbed >= touches - upserts


async def test_absorb_zero_holds_no_key_back_after_its_write(
        make: Make, redis_url: str) -> None:
    c = await make(redis_url, absorb="0s")
    due = c.keyspace.shard(0).due("stats")
    c.touch("stats:1")
    await c.flush()
    first = await c.redis.zscore(due, "stats:1")
    c.touch("stats:1")  # right after its write: written again at once
    await c.flush()
    assert first is not None and await c.redis.zscore(due, "stats:1") is not None
    assert c.metrics.registry.get_sample_value("coalescer_absorbed_touches_total") == 0


@pytest.mark.usefixtures("no_counts")
async def test_distinct_keys_are_batched_at_most_0_02_commands_per_key(
        make: Make, own_server: ValkeyProcess) -> None:
    c = await make(own_server.url)
    n = 10_000
    before = await command_calls(c.redis)
    for i in range(n):
        c.touch(f"stats:{i}")
        if i % 500 == 0:
            await asyncio.sleep(0)
    await c.flush()
    after = await command_calls(c.redis)

    commands = client_commands(before, after)
    assert commands <= 0.02 * n, after
    assert delta(before, after, "evalsha", "eval") <= 0.02 * n
    assert await c.redis.zcard(c.keyspace.shard(0).due("stats")) == n


async def test_a_bulk_flush_goes_out_in_calls_of_at_most_500_keys(
        make: Make, own_server: ValkeyProcess, upsert_sizes: list[tuple[int, int]]) -> None:
    """Each upsert call holds Redis a millisecond or two: 1,250 keys buffered at once are
    written by three calls (500, 500 and 250 keys), every key once."""
    c = await make(own_server.url)
    for i in range(1_250):
        c.touch(f"stats:{i}")
    await c.flush()
    assert sorted(keys for keys, _ in upsert_sizes) == [250, 500, 500]
    assert await c.redis.zcard(c.keyspace.shard(0).due("stats")) == 1_250


ITEM_RULES = """\
namespace: {ns}
shards: 1
defaults:
  window: 10s
  absorb: 50ms
rules:
  - name: bag
    match: "bag:{{id}}"
    items: {{max: 100}}
    handler: builtins:print
"""


async def test_keys_with_items_go_out_in_calls_of_at_most_5000_keys_and_items(
        rules_file: Callable[..., Any], namespace: str, own_server: ValkeyProcess,
        upsert_sizes: list[tuple[int, int]]) -> None:
    """60 keys with 100 items each (6,060 keys and items) take two calls, and every key
    keeps all its items."""
    path = rules_file(ITEM_RULES.format(ns=namespace))
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as c:
        for i in range(60):
            for j in range(100):
                c.touch(f"bag:{i}", f"item-{j}")
        await c.flush()
        shard = c.keyspace.shard(0)
        sizes = {await c.redis.scard(shard.items(f"bag:{i}")) for i in range(60)}
    assert len(upsert_sizes) == 2 and sum(keys for keys, _ in upsert_sizes) == 60
    assert all(written <= 5_000 for _, written in upsert_sizes), upsert_sizes
    assert sizes == {100}


async def test_touches_survive_redis_being_down_and_are_written_once_it_is_back(
        make: Make, own_server: ValkeyProcess) -> None:
    c = await make(own_server.url)
    due_key = c.keyspace.shard(0).due("stats")
    c.touch("stats:before")
    await c.flush()

    own_server.stop()
    keys = [f"stats:{i}" for i in range(50)]
    for key in keys:
        c.touch(key)  # accepted: touch() never waits for Redis
    with pytest.raises(RedisUnreachableError):
        await c.flush()
    await wait_until(lambda: buffered(c) == len(keys), message="50 keys buffered")

    own_server.start()
    await c.flush()
    assert await c.redis.zcard(due_key) == len(keys)  # (it kept no data: no AOF)
    scores = await c.redis.zmscore(due_key, keys)
    assert None not in scores


async def test_backpressure_bound_with_redis_down(make: Make, own_server: ValkeyProcess) -> None:
    c = await make(own_server.url, max_buffered=100)
    due_key = c.keyspace.shard(0).due("stats")
    own_server.stop()
    accepted = [f"stats:{i}" for i in range(100)]
    for key in accepted:
        c.touch(key)
    with pytest.raises(BackpressureError, match="stats:100"):
        c.touch("stats:100")
    c.touch("stats:7")  # a key already buffered is still accepted

    # However long Redis stays down and however often the flusher retries,
    # the bound holds: new keys keep being refused.
    def flusher_errors() -> float:
        return c.metrics.registry.get_sample_value(
            "coalescer_redis_errors_total", {"loop": "flusher"}) or 0.0

    refused = 0
    while flusher_errors() < 2:
        try:
            c.touch(f"stats:extra{refused}")
        except BackpressureError:
            refused += 1
        else:
            accepted.append(f"stats:extra{refused}")
        await asyncio.sleep(0.001)
    assert len(accepted) == 100, f"{len(accepted) - 100} keys over the bound were accepted"

    own_server.start()
    await c.flush()
    assert await c.redis.zcard(due_key) == len(accepted)


async def test_an_unknown_key_is_refused_by_name(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis) -> None:
    c = await make(redis_url)
    with pytest.raises(UnknownKeyError, match="users:1") as info:
        c.touch("users:1")
    assert info.value.key == "users:1"
    await c.flush()
    assert await redis_client.exists(c.keyspace.shard(0).meta) == 0


async def test_touch_after_close_raises_and_close_is_idempotent(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis) -> None:
    c = await make(redis_url)
    c.touch("stats:1")
    await c.close()  # a clean shutdown flushes first
    assert await redis_client.zscore(c.keyspace.shard(0).due("stats"), "stats:1") is not None
    with pytest.raises(ClosedError, match="stats:2"):
        c.touch("stats:2")
    await c.close()
    await asyncio.gather(c.close(), c.close())
    with pytest.raises(ClosedError):
        c.touch("stats:2")


async def test_touch_before_start_raises(rules_file: Callable[..., Any], namespace: str,
                                         redis_url: str) -> None:
    path = rules_file(RULES.format(ns=namespace, shards=1, absorb="50ms"))
    c = Coalescer.from_yaml(path, redis_url=redis_url, worker=False)
    with pytest.raises(ClosedError):
        c.touch("stats:1")
    await c.close()


async def test_shards_spread_keys_and_every_key_carries_its_shard_hash_tag(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis, namespace: str) -> None:
    c = await make(redis_url, shards=4)
    keys = {f"stats:{i}" for i in range(400)}
    for key in keys:
        c.touch(key)
    await c.flush()

    seen: set[str] = set()
    for n in range(4):
        members = set(await redis_client.zrange(c.keyspace.shard(n).due("stats"), 0, -1))
        assert 50 <= len(members) <= 150, f"shard {n} holds {len(members)} of 400"
        assert not members & seen
        seen |= members
        assert set(await redis_client.hkeys(c.keyspace.shard(n).meta)) == members
    assert seen == keys

    names = [k async for k in redis_client.scan_iter(match=f"{namespace}:*")]
    assert layout(namespace) in names  # the namespace's layout: the nodes' tag, no shard's
    names.remove(layout(namespace))
    names.remove(protocol_version(namespace))  # the touch protocol's version: the same tag
    assert names
    slots: dict[int, set[int]] = {}
    for name in names:
        tags = [n for n in range(4) if name.startswith(f"{namespace}:{{{namespace}:{n}}}:")]
        assert len(tags) == 1, f"{name} carries no shard hash tag"
        slots.setdefault(tags[0], set()).add(key_slot(name.encode()))
    assert sorted(slots) == [0, 1, 2, 3]
    assert all(len(s) == 1 for s in slots.values())  # one cluster slot per shard


# -- writes in flight ------------------------------------------------------------------------


class Gate:
    """Stands between the flusher and Redis: logs each upsert call's start and end
    (with its keys) and holds the calls with a ``blocked`` key until ``release()``;
    ``after`` holds them once Redis has run them instead of before. While ``error`` is
    set, a held call raises it instead of reaching Redis; ``failures`` set, it is
    cleared after that many raises (Redis comes back)."""

    def __init__(self, c: Coalescer, monkeypatch: pytest.MonkeyPatch, *blocked: str,
                 after: bool = False) -> None:
        scripts = c._run.flusher._scripts  # type: ignore[union-attr]
        self._real = scripts.upsert_keys
        self.blocked = set(blocked)
        self.after = after
        self.error: BaseException | None = None
        self.failures: int | None = None
        self.log: list[tuple[str, frozenset[str]]] = []
        self._open = asyncio.Event()
        monkeypatch.setattr(scripts, "upsert_keys", self._upsert_keys)

    def release(self) -> None:
        self._open.set()

    def started(self, key: str) -> list[int]:
        """Where the calls with ``key`` started in the log."""
        return [i for i, (what, keys) in enumerate(self.log) if what == "start" and key in keys]

    def ended(self, key: str) -> list[int]:
        return [i for i, (what, keys) in enumerate(self.log) if what == "end" and key in keys]

    async def _upsert_keys(self, shard: Any, groups: Any, gen: int = 1, min_seq: int = 0) -> Any:
        keys = frozenset(k for g in groups for k in g.keys)
        self.log.append(("start", keys))
        try:
            held = bool(keys & self.blocked)
            if held and not self.after:
                await self._open.wait()
                if self.error is not None:
                    error = self.error
                    if self.failures is not None:
                        self.failures -= 1
                        self.error = None if self.failures <= 0 else error
                    raise error
            result = await self._real(shard, groups, gen, min_seq)
            if held and self.after:
                await self._open.wait()
            return result
        finally:
            self.log.append(("end", keys))


def last_touch_ms(state: str | None) -> int:
    """The last touch of a pending key's state."""
    pending = states.pending(state) if state else None
    assert pending is not None, state
    return pending.last_ms


async def test_a_key_touched_while_its_write_is_in_flight_is_written_after_that_write(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = await make(redis_url, absorb="20ms")
    meta = c.keyspace.shard(0).meta
    gate = Gate(c, monkeypatch, "stats:1", after=True)  # Redis runs it; the answer waits
    c.touch("stats:1")
    await wait_until(lambda: redis_client.hget(meta, "stats:1"), message="first write run")
    first = last_touch_ms(await redis_client.hget(meta, "stats:1"))
    await wait_until(lambda: _later(redis_client, first), message="the server clock to move on")
    retouched = await server_ms(redis_client)
    c.touch("stats:1")  # its write is still in flight
    c.touch("stats:2")
    await wait_until(lambda: gate.ended("stats:2"), message="stats:2 written meanwhile")
    assert len(gate.started("stats:1")) == 1  # held: not written twice at once

    gate.release()
    await wait_until(lambda: len(gate.ended("stats:1")) == 2, message="the re-touch written")
    assert gate.started("stats:1")[1] > gate.ended("stats:1")[0]
    assert last_touch_ms(await redis_client.hget(meta, "stats:1")) >= retouched
    assert len(c._run.absorber) == 0


async def gated_coalescer(make: Make, redis_url: str,
                          monkeypatch: pytest.MonkeyPatch) -> tuple[Coalescer, Gate]:
    """A coalescer whose writes of stats:a and stats:b wait at a gate."""
    c = await make(redis_url)
    return c, Gate(c, monkeypatch, "stats:a", "stats:b")


async def two_writes_in_flight(c: Coalescer, gate: Gate) -> None:
    """Touch stats:a, and stats:b once stats:a's write is in flight: two writes at once."""
    c.touch("stats:a")
    await wait_until(lambda: gate.started("stats:a"), message="stats:a in flight")
    c.touch("stats:b")
    await wait_until(lambda: gate.started("stats:b"), message="stats:b in flight")


async def _later(client: redis.asyncio.Redis, ms: int) -> bool:
    return await server_ms(client) > ms


async def test_flush_waits_for_both_writes_in_flight(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c, gate = await gated_coalescer(make, redis_url, monkeypatch)
    due_key = c.keyspace.shard(0).due("stats")
    await two_writes_in_flight(c, gate)
    assert not set(gate.started("stats:a")) & set(gate.started("stats:b"))  # two writes

    c.touch("stats:c")
    flush = asyncio.ensure_future(c.flush())
    await wait_until(lambda: gate.ended("stats:c"), message="flush() to write stats:c")
    for _ in range(20):
        await asyncio.sleep(0)
    assert not flush.done()  # stats:a and stats:b are not in Redis yet
    assert await redis_client.zcard(due_key) == 1

    gate.release()
    await flush
    assert set(await redis_client.zrange(due_key, 0, -1)) == {"stats:a", "stats:b", "stats:c"}


async def test_flush_writes_again_what_a_write_in_flight_failed_to_write(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c, gate = await gated_coalescer(make, redis_url, monkeypatch)
    due_key = c.keyspace.shard(0).due("stats")
    gate.error, gate.failures = RedisConnectionError("injected"), 2
    await two_writes_in_flight(c, gate)
    flush = asyncio.ensure_future(c.flush())
    for _ in range(5):
        await asyncio.sleep(0)  # flush() now waits for the two writes
    gate.release()  # both fail, then Redis answers again

    await flush  # does not raise the error those two writes met
    assert set(await redis_client.zrange(due_key, 0, -1)) == {"stats:a", "stats:b"}
    assert len(gate.started("stats:a")) >= 2 and len(gate.started("stats:b")) >= 2


async def test_flush_raises_when_redis_still_refuses_what_failed_in_flight(
        make: Make, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c, gate = await gated_coalescer(make, redis_url, monkeypatch)
    gate.error = RedisConnectionError("injected")
    await two_writes_in_flight(c, gate)
    flush = asyncio.ensure_future(c.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    gate.release()
    with pytest.raises(RedisUnreachableError, match="injected"):
        await flush
    assert len(c._run.absorber) == 2  # given back, not lost
    gate.error = None  # Redis heals: close() writes them


async def test_a_transient_error_with_two_writes_in_flight_loses_nothing(
        make: Make, redis_url: str, redis_client: redis.asyncio.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c, gate = await gated_coalescer(make, redis_url, monkeypatch)
    due_key = c.keyspace.shard(0).due("stats")
    gate.error = RedisConnectionError("injected")
    await two_writes_in_flight(c, gate)

    gate.release()  # both fail: their keys are given back, and retried
    await wait_until(lambda: (c.metrics.registry.get_sample_value(
        "coalescer_redis_errors_total", {"loop": "flusher"}) or 0) >= 1,
        message="the flusher to meet the error")
    gate.error = None
    await wait_until(lambda: len(c._run.absorber) == 0, message="every key written")
    assert set(await redis_client.zrange(due_key, 0, -1)) == {"stats:a", "stats:b"}
    assert len(gate.started("stats:a")) >= 2 and len(gate.started("stats:b")) >= 2
