"""Keys Redis cannot store, and writes Redis refuses: one bad key never blocks another.

A key that cannot be stored is refused at ``touch()`` (and by the CLI); a key that
got past that check anyway, or one whose state in Redis is corrupted, is found by
the flusher and dropped alone, logged and counted, while every other key is written.
Transient errors (a read-only replica here) are retried and lose nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    DataError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer import Coalescer, InvalidKeyError, KeyRefusedError, UnknownKeyError
from coalescer.errors import ScriptError
from coalescer.store import key_states as states
from coalescer.store.keycheck import MAX_KEY_BYTES
from coalescer.store.keys import KeySpace
from coalescer.write.failures import is_transient
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.servers import ValkeyProcess, free_port, wait_until

# Only defaults: window 2s, max_wait 30s, absorb 50ms, concurrency 16.
RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: stats
    match: "stats:*"
    handler: builtins:print
"""

Make = Callable[..., Awaitable[Coalescer]]


@pytest_asyncio.fixture
async def make(rules_file: Callable[..., Path], namespace: str) -> AsyncIterator[Make]:
    started: list[Coalescer] = []

    async def build(url: str, *, shards: int = 1) -> Coalescer:
        path = rules_file(RULES.format(ns=namespace, shards=shards))
        c = Coalescer.from_yaml(path, redis_url=url, worker=False)
        await c.start()
        started.append(c)
        return c

    yield build
    for c in started:
        await c.close()


async def due_keys(client: Any, namespace: str, shards: int) -> set[str]:
    """Every key scheduled in Redis, over all shards."""
    found: set[str] = set()
    for sk in KeySpace(namespace, shards).all_shards():
        found |= set(await client.zrange(sk.due("stats"), 0, -1))
    return found


def dropped_total(c: Coalescer, reason: str) -> float:
    value = c.metrics.registry.get_sample_value("coalescer_dropped_keys_total",
                                                {"reason": reason})
    return value or 0.0


UNSTORABLE = [
    pytest.param("stats:user:\ud800", "lone surrogate", id="lone-surrogate"),
    pytest.param("stats:user:\udcff", "lone surrogate", id="undecodable-argv-byte"),
    pytest.param("stats:user:1\x002", "NUL character (at index 12)", id="nul"),
    pytest.param("stats:" + "x" * (MAX_KEY_BYTES - 5), "1025 bytes long", id="too-long"),
    pytest.param("stats:" + "é" * 510, "1026 bytes long", id="too-long-in-utf8"),
]


# -- refused at touch() -----------------------------------------------------------------


@pytest.mark.parametrize(("key", "says"), UNSTORABLE)
async def test_touch_refuses_a_key_redis_cannot_store_by_name(
        make: Make, redis_url: str, redis_client: Any, *, namespace: str, key: str,
        says: str) -> None:
    c = await make(redis_url)
    with pytest.raises(InvalidKeyError) as info:
        c.touch(key)
    assert isinstance(info.value, KeyRefusedError) and isinstance(info.value, KeyError)
    assert not isinstance(info.value, UnknownKeyError)
    assert info.value.key == key
    assert says in str(info.value) and "cannot be stored" in str(info.value)
    assert "stats:" in str(info.value)
    # Nothing was buffered, and the node goes on writing every other key.
    c.touch("stats:user:ok")
    await c.flush()
    assert await due_keys(redis_client, namespace, 1) == {"stats:user:ok"}
    assert c.unwritten_age() is None
    assert c.dropped_keys() == []


async def test_a_key_of_exactly_the_limit_is_written(
        make: Make, redis_url: str, redis_client: Any, namespace: str) -> None:
    c = await make(redis_url)
    longest = "stats:" + "é" * ((MAX_KEY_BYTES - 6) // 2)  # 1024 bytes in UTF-8
    assert len(longest.encode()) == MAX_KEY_BYTES
    c.touch(longest)
    c.touch("stats:ünïcode:✓")
    await c.flush()
    assert await due_keys(redis_client, namespace, 1) == {longest, "stats:ünïcode:✓"}


async def test_touch_many_with_one_unstorable_key_applies_nothing(
        make: Make, redis_url: str, redis_client: Any, namespace: str) -> None:
    c = await make(redis_url)
    with pytest.raises(InvalidKeyError, match="lone surrogate"):
        c.touch_many(["stats:1", "stats:\ud800", "stats:2"])
    await c.flush()
    assert await due_keys(redis_client, namespace, 1) == set()
    c.touch_many(["stats:1", "stats:2"])
    await c.flush()
    assert await due_keys(redis_client, namespace, 1) == {"stats:1", "stats:2"}


def test_cli_touch_of_an_undecodable_argument_is_one_line_and_exit_2(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    import subprocess

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace, shards=1))
    # An argv byte that is not UTF-8 reaches Python as a lone surrogate escape.
    done = subprocess.run([*coalescer_cmd(), "touch", "stats:1", "stats:user:\udcff",
                           "--rules", str(rules), "--redis", redis_url],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          errors="backslashreplace", timeout=60, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "stats:user:\\udcff" in lines[0]
    assert "cannot be stored" in lines[0] and "nothing was touched" in lines[0]
    assert "Traceback" not in done.stderr


# -- dropped by the flusher ---------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 4])
async def test_a_key_that_got_past_the_check_is_dropped_alone_and_the_rest_written(
        make: Make, redis_url: str, redis_client: Any, *, namespace: str, shards: int,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    c = await make(redis_url, shards=shards)
    good = [f"stats:{i}" for i in range(300)]
    bad = ["stats:\ud800", "stats:\udcff"]
    # The way in for a key that somehow got past validation: touch without the check.
    monkeypatch.setattr("coalescer.write.absorber.check_key", lambda key: None)
    c.touch_many([*good[:100], bad[0], *good[100:200], bad[1], *good[200:]])
    monkeypatch.undo()

    with caplog.at_level(logging.ERROR, logger="coalescer.write.flusher"):
        await c.flush()  # returns: the bad keys do not hold the others back

    assert await due_keys(redis_client, namespace, shards) == set(good)
    assert dropped_total(c, "invalid_key") == 2
    assert sorted(d["key"] for d in c.dropped_keys()) == sorted(bad)
    assert all("UnicodeEncodeError" in d["error"] for d in c.dropped_keys())
    lines = [r.getMessage() for r in caplog.records if "dropped key" in r.getMessage()]
    assert len(lines) == 2
    assert any("'stats:\\ud800'" in line for line in lines)
    assert len(c._run.absorber) == 0 and c.unwritten_age() is None

    c.touch("stats:later")  # the node still writes
    await c.flush()
    assert "stats:later" in await due_keys(redis_client, namespace, shards)


async def test_a_key_redis_fails_on_is_dropped_and_the_rest_written(
        make: Make, redis_url: str, redis_client: Any, namespace: str) -> None:
    c = await make(redis_url)
    meta = KeySpace(namespace, 1).shard(0).meta
    # A corrupted state of one key (e.g. written by something else): the upsert script
    # fails on that key alone.
    await redis_client.hset(meta, "stats:corrupt", "P|not-a-number")
    keys = [f"stats:{i}" for i in range(50)]
    c.touch_many([*keys[:25], "stats:corrupt", *keys[25:]])
    await c.flush()

    assert await due_keys(redis_client, namespace, 1) == set(keys)
    assert dropped_total(c, "redis_error") == 1
    [dropped] = c.dropped_keys()
    assert dropped["key"] == "stats:corrupt"
    assert dropped["reason"] == "redis_error"
    assert "nil value" in dropped["error"]
    values = await redis_client.hmget(meta, keys)
    assert all(states.kind(value) == "pending" for value in values)
    assert len(c._run.absorber) == 0


async def test_upsert_raises_script_error_naming_a_failed_key(
        make: Make, redis_url: str, redis_client: Any, namespace: str) -> None:
    c = await make(redis_url)
    sk = KeySpace(namespace, 1).shard(0)
    await redis_client.hset(sk.meta, "stats:corrupt", "P|x")
    from coalescer.store.script_types import UpsertGroup
    from coalescer.store.scripts import Scripts
    scripts = Scripts(redis_client)
    with pytest.raises(ScriptError, match="stats:corrupt"):
        await scripts.upsert(sk, [UpsertGroup("stats", 100, 1000, ["stats:a", "stats:corrupt"])])
    assert await redis_client.zscore(sk.due("stats"), "stats:a") is not None
    assert c.dropped_keys() == []


# -- transient errors: retried, nothing lost -----------------------------------------------


@pytest.mark.parametrize("exc", [
    RedisConnectionError("Connection refused"), RedisTimeoutError("Timeout reading"),
    BusyLoadingError("Redis is loading the dataset in memory"),
    ReadOnlyError("You can't write against a read only replica."),
    MasterDownError("Link with MASTER is down"), ClusterDownError("The cluster is down"),
    TryAgainError("Multiple keys request during rehashing of slot"),
    ResponseError("BUSY Redis is busy running a script."), ConnectionResetError(),
    TimeoutError(), asyncio.CancelledError(),
    ResponseError("MISCONF Errors writing to the AOF file", status_code="MISCONF"),
    ResponseError("MISCONF Redis is configured to save RDB snapshots"),
    OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    NoPermissionError("this user has no permissions to access one of the keys"),
    ResponseError("NOREPLICAS Not enough good replicas to write."),
    ResponseError("ERR a reply coalescer has never seen"), ResponseError("no code at all"),
    ResponseError("ERR unknown command 'x' script: 9f86d0, on @user_script:30.",
                  status_code="ERR"),
    ScriptError("claim answered 7"),
])
def test_errors_that_are_not_about_a_key_are_retried(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ResponseError("user_script:1: attempt to perform arithmetic on a nil value"),
    DataError("Invalid input"), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates"),
    ValueError("a value the client cannot encode"),
])
def test_errors_about_a_key_are_split_and_dropped(exc: BaseException) -> None:
    assert not is_transient(exc)


async def test_a_read_only_server_loses_nothing_and_drops_nothing(
        own_server: ValkeyProcess, make: Make, namespace: str) -> None:
    server = own_server
    c = await make(server.url)
    admin = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        await admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # read-only
        keys = [f"stats:{i}" for i in range(20)]
        c.touch_many(keys)

        def flusher_errors() -> bool:
            value = c.metrics.registry.get_sample_value("coalescer_redis_errors_total",
                                                        {"loop": "flusher"})
            return bool(value and value >= 2)

        await wait_until(flusher_errors, timeout=10, message="the flusher to meet READONLY")
        assert len(c._run.absorber) == len(keys)  # kept, not dropped
        assert c.dropped_keys() == [] and dropped_total(c, "redis_error") == 0
        assert await due_keys(admin, namespace, 1) == set()

        await admin.execute_command("REPLICAOF", "NO", "ONE")
        await c.flush()
        assert await due_keys(admin, namespace, 1) == set(keys)
        assert c.dropped_keys() == []
    finally:
        await admin.aclose()
