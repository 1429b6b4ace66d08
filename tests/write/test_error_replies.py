"""Error replies of a real server that are not about any key (MISCONF, READONLY,
NOREPLICAS, NOPERM, BUSY, OOM, an unknown one): the touches accepted meanwhile stay
buffered and are all written once the server takes writes again; /healthz answers
503 with the reply while it lasts, and the log shows the reply once."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis

from coalescer import BackpressureError, Coalescer
from coalescer.errors import RedisRefusesWritesError
from coalescer.web.api import HttpApi
from tests.helpers.servers import ValkeyProcess, poll_until, wait_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 10s
    handler: builtins:print
"""
KEYS = [f"stats:{i}" for i in range(20)]

Lift = Callable[[], object]


class Writer:
    """A started write-path coalescer with its HTTP API."""

    def __init__(self, c: Coalescer, api: HttpApi, http: aiohttp.ClientSession) -> None:
        self.c = c
        self.api = api
        self.http = http

    async def healthz(self) -> tuple[int, dict[str, Any]]:
        async with self.http.get(f"http://127.0.0.1:{self.api.port}/healthz") as response:
            return response.status, await response.json()

    def refused(self, code: str) -> float:
        value = self.c.metrics.registry.get_sample_value(
            "coalescer_redis_refused_writes_total", {"code": code})
        return value or 0.0

    async def due(self, client: redis.Redis) -> set[str]:
        return set(client.zrange(self.c.keyspace.shard(0).due("stats"), 0, -1))


Make = Callable[[str], Awaitable[Writer]]


@pytest_asyncio.fixture
async def writer(rules_file: Callable[..., Path], namespace: str) -> AsyncIterator[Make]:
    opened: list[tuple[Coalescer, HttpApi, aiohttp.ClientSession]] = []

    async def make(url: str) -> Writer:
        c = Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)), redis_url=url,
                                worker=False)
        await c.start()
        api = HttpApi(c, port=0)
        await api.start()
        http = aiohttp.ClientSession()
        opened.append((c, api, http))
        return Writer(c, api, http)

    yield make
    for c, api, http in reversed(opened):
        await http.close()
        await api.close()
        await c.close()


async def ride_out(w: Writer, admin: redis.Redis, code: str, lift: Lift,
                   caplog: pytest.LogCaptureFixture, *, readable: bool = True) -> None:
    """Touch during the fault, check what shows it, lift it, check all is written
    (``readable``: whether the server answers reads during the fault)."""
    w.c.touch_many(KEYS)
    await wait_until(lambda: w.refused(code) >= 3, message=f"three writes refused with {code}")
    status, body = await w.healthz()
    assert status == 503
    assert f"Redis refuses writes: {code}" in body["error"]
    assert w.c.unwritten_age() is not None
    assert not readable or await w.due(admin) == set()
    assert w.c.dropped_keys() == []

    done = lift()
    if inspect.isawaitable(done):
        await done
    await w.c.flush()
    assert await w.due(admin) == set(KEYS)
    status, body = await w.healthz()
    assert (status, body["ok"]) == (200, True)
    told = [r.getMessage() for r in caplog.records if code in r.getMessage()]
    assert len(told) == 1, told
    assert sum("Redis takes writes again after" in r.getMessage()
               for r in caplog.records) == 1
    assert w.c.dropped_keys() == []


async def test_misconf_after_a_failed_snapshot(writer: Make, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "home"
    server = ValkeyProcess(dir=home, extra_args=["--enable-protected-configs", "yes",
                                                  "--save", "3600 1"])
    admin = server.client()
    try:
        w = await writer(server.url)
        caplog.clear()
        gone = tmp_path / "gone"
        gone.mkdir()
        admin.config_set("dir", str(gone))
        gone.rmdir()  # the snapshot cannot be written: a full or lost disk
        snapshot(admin, "err")

        def lift() -> None:
            admin.config_set("dir", str(home))
            snapshot(admin, "ok")

        await ride_out(w, admin, "MISCONF", lift, caplog)
    finally:
        admin.close()
        server.stop()


def snapshot(admin: redis.Redis, expected: str) -> None:
    """BGSAVE, and wait until the last one's status is ``expected``."""
    admin.bgsave()

    def finished() -> bool:
        info: Any = admin.info("persistence")
        return (not info["rdb_bgsave_in_progress"]
                and info["rdb_last_bgsave_status"] == expected)

    poll_until(finished, message=f"a snapshot with status {expected}")


async def test_readonly_while_a_replica(writer: Make, own_server: ValkeyProcess,
                                        tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    primary = ValkeyProcess(dir=tmp_path / "primary",
                            extra_args=["--repl-diskless-sync-delay", "0"])
    admin = own_server.client()
    try:
        w = await writer(own_server.url)
        caplog.clear()
        admin.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        poll_until(lambda: admin.info("replication")["master_link_status"] == "up",
                   message="the replica to sync")
        await ride_out(w, admin, "READONLY",
                       lambda: admin.execute_command("REPLICAOF", "NO", "ONE"), caplog)
    finally:
        admin.close()
        primary.stop()


async def test_noreplicas_below_min_replicas_to_write(
        writer: Make, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    admin = own_server.client()
    try:
        w = await writer(own_server.url)
        caplog.clear()
        admin.config_set("min-replicas-to-write", 1)
        await ride_out(w, admin, "NOREPLICAS",
                       lambda: admin.config_set("min-replicas-to-write", 0), caplog)
    finally:
        admin.close()


async def test_noperm_for_an_acl_user_without_the_keys(
        writer: Make, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    admin = own_server.client()
    try:
        admin.execute_command("ACL", "SETUSER", "app", "on", ">app-pw", "+@all", "~*", "&*")
        w = await writer(own_server.url.replace("redis://", "redis://app:app-pw@"))
        caplog.clear()
        admin.execute_command("ACL", "SETUSER", "app", "resetkeys", "~other:*")
        await ride_out(w, admin, "NOPERM",
                       lambda: admin.execute_command("ACL", "SETUSER", "app", "~*"), caplog)
    finally:
        admin.close()


async def test_busy_while_a_script_runs_past_the_threshold(
        writer: Make, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    admin = own_server.client()
    looping = own_server.client(timeout=30)
    ended: list[BaseException] = []

    def loop_forever() -> None:
        try:
            looping.eval("while true do end", 0)
        except redis.RedisError as exc:  # SCRIPT KILL ends it with an error
            ended.append(exc)

    thread = threading.Thread(target=loop_forever)
    try:
        w = await writer(own_server.url)
        caplog.clear()
        admin.config_set("busy-reply-threshold", 20)
        thread.start()
        poll_until(lambda: is_busy(admin), message="the script to make the server busy")

        async def lift() -> None:
            admin.script_kill()
            await asyncio.to_thread(thread.join)

        await ride_out(w, admin, "BUSY", lift, caplog, readable=False)
        assert ended  # the script was killed, not finished
    finally:
        if thread.is_alive():
            admin.script_kill()
            thread.join()
        admin.close()
        looping.close()


def is_busy(admin: redis.Redis) -> bool:
    try:
        admin.ping()
    except redis.exceptions.BusyLoadingError:
        return False
    except redis.ResponseError as exc:
        return str(exc).startswith("BUSY")
    return False


async def test_oom_at_maxmemory_with_noeviction(
        writer: Make, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    admin = own_server.client()
    try:
        w = await writer(own_server.url)
        caplog.clear()
        admin.config_set("maxmemory", 1)  # the default policy is noeviction
        await ride_out(w, admin, "OOM", lambda: admin.config_set("maxmemory", 0), caplog)
    finally:
        admin.close()


async def test_a_reply_coalescer_does_not_know_keeps_the_touches(
        writer: Make, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = ValkeyProcess(dir=tmp_path, extra_args=["--rename-command", "EVALSHA", ""])
    admin = server.client()
    try:
        w = await writer(server.url)
        caplog.clear()

        def lift() -> None:  # the same server, without the rename
            server.stop()
            server.extra_args = []
            server.start()

        await ride_out(w, admin, "ERR", lift, caplog)
    finally:
        admin.close()
        server.stop()


async def test_backpressure_and_flush_say_redis_refuses_writes(
        rules_file: Callable[..., Path], namespace: str, own_server: ValkeyProcess) -> None:
    admin = own_server.client()
    c = Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)), redis_url=own_server.url,
                            worker=False, max_buffered=5)
    await c.start()
    try:
        admin.config_set("maxmemory", 1)
        c.touch_many(KEYS[:5])
        with pytest.raises(RedisRefusesWritesError, match="OOM command not allowed") as info:
            await c.flush()
        assert info.value.code == "OOM"
        with pytest.raises(BackpressureError, match="Redis refuses writes: OOM") as full:
            c.touch("stats:one-too-many")
        assert "reachable" not in str(full.value)
        admin.config_set("maxmemory", 0)
        await c.flush()
    finally:
        await c.close()
        admin.close()
