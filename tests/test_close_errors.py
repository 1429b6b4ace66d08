"""close() that cannot write every accepted touch raises, with the count and the keys,
after releasing everything; it never returns as if all were written."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from coalescer import Coalescer, SyncCoalescer
from coalescer.errors import RedisRefusesWritesError, UnwrittenTouchesError
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 10s
    handler: builtins:print
"""
KEYS = [f"stats:{i}" for i in range(50)]


@pytest.fixture
def rules(rules_file: Callable[..., Path], namespace: str) -> Path:
    return rules_file(RULES.format(ns=namespace))


@pytest.mark.parametrize("worker", [False, True])
async def test_close_with_the_server_stopped_raises_with_the_keys(
        rules: Path, own_server: ValkeyProcess, worker: bool) -> None:
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=worker, grace=0.5)
    await c.start()
    own_server.stop()
    c.touch_many(KEYS)
    with pytest.raises(UnwrittenTouchesError, match="50 touched keys were not written") as info:
        await c.close(flush_timeout=0.5)
    assert info.value.count == 50
    assert info.value.keys == sorted(KEYS)
    assert "could not be reached" in info.value.reason
    await c.close()  # closed and released: a second close returns at once
    assert "closed" in repr(c)


async def test_close_while_redis_refuses_writes_says_why(
        rules: Path, own_server: ValkeyProcess) -> None:
    admin = own_server.client()
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False)
    await c.start()
    try:
        admin.config_set("maxmemory", 1)
        c.touch_many(KEYS[:3])
        with pytest.raises(RedisRefusesWritesError):
            await c.flush()
        with pytest.raises(UnwrittenTouchesError, match="Redis refuses writes: OOM") as info:
            await c.close(flush_timeout=0.3)
        assert info.value.keys == sorted(KEYS[:3])
        assert admin.client_list() and len(admin.client_list()) == 1  # only ours is left
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()


async def test_close_keeps_trying_until_redis_is_back(
        rules: Path, own_server: ValkeyProcess) -> None:
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False)
    await c.start()
    own_server.stop()
    c.touch_many(KEYS)
    closing = asyncio.ensure_future(c.close(flush_timeout=30))
    await wait_until(lambda: c.metrics.registry.get_sample_value(
        "coalescer_redis_errors_total", {"loop": "flusher"}) or "closing" in repr(c),
        message="close to meet the stopped server")
    own_server.start()
    await closing  # written: no error
    with own_server.client() as admin:
        due = admin.zrange(c.keyspace.shard(0).due("stats"), 0, -1)
    assert sorted(due) == sorted(KEYS)


def test_a_sync_writer_close_raises_and_stops_its_thread(
        rules: Path, own_server: ValkeyProcess) -> None:
    writer = SyncCoalescer.from_yaml(rules, redis_url=own_server.url)
    writer.start()
    own_server.stop()
    writer.touch("stats:1")
    with pytest.raises(UnwrittenTouchesError) as info:
        writer.close(flush_timeout=0.3)
    assert (info.value.count, info.value.keys) == (1, ["stats:1"])
    writer.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        writer.touch("stats:2")


async def test_an_error_of_the_body_is_not_hidden_by_unwritten_touches(
        rules: Path, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False)
    close = c.close
    monkeypatch.setattr(c, "close", lambda: close(flush_timeout=0.3))  # 'async with' calls it
    with pytest.raises(ZeroDivisionError):
        async with c:
            own_server.stop()
            c.touch("stats:1")
            1 / 0  # noqa: B018
    assert any("1 touched keys were not written" in r.message for r in caplog.records)
