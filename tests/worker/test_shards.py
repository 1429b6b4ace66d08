"""Many shards (up to the 16,384 the rules allow): connections stay bounded, every key is
refreshed, status reads in a few round trips, leadership logs a summary, shutdown is clean.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.common.plural import plural
from coalescer.config.rules import Config
from coalescer.query.status import gather_status
from coalescer.store.connection import LEASE_CONNECTIONS, MAX_CONNECTIONS, connect
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import NodeProcs, line_rules, read_lines, recorder_rules
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: {mod}:refresh
"""


def received(server: ValkeyProcess) -> int:
    """Connections the server has accepted since it started."""
    client = server.client()
    try:
        return int(client.info("stats")["total_connections_received"])
    finally:
        client.close()


def problems(records: list[logging.LogRecord]) -> list[str]:
    """Warnings, errors and tracebacks logged (asyncio's "Task was destroyed" included)."""
    return [f"{r.name}: {r.getMessage()}" for r in records
            if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("shards", [1, 512])
async def test_many_shards_refresh_every_key_on_bounded_connections_and_close_cleanly(
        shards: int, own_server: ValkeyProcess, namespace: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path, rec = recorder_rules(tmp_path, f"rec_{namespace}",
                               RULES.format(ns=namespace, shards=shards, mod="{mod}"))
    keys = [f"stats:{i}" for i in range(min(2000, max(50, 2 * shards)))]
    before = received(own_server)
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as writer:
        writer.touch_many(keys)
        await writer.flush()  # one upsert per shard, all at once
    async with Coalescer.from_yaml(path, redis_url=own_server.url, node_id="big") as node:
        await wait_until(lambda: len(node.leads()) == shards, timeout=60,
                         message="the node leads every shard")
        await wait_until(lambda: {c.key for c in rec.calls} == set(keys), timeout=120,
                         message="every key refreshed")
        status = await node.query.status()
        assert {s["leader"] for s in status["shards"]} == {"big"}
        summary = f"big leads {shards} of {plural(shards, 'shard')}"
        await wait_until(lambda: any(summary in r.getMessage() for r in caplog.records),
                         timeout=30, message="the leadership summary line")
    assert len(rec.calls) == len(keys), "each key refreshed exactly once"
    # Two clients (writer, node), each with its pool and the probe of its start, and the
    # node's connections of its own for lease calls.
    assert received(own_server) - before <= 2 * (MAX_CONNECTIONS + 1) + LEASE_CONNECTIONS
    assert problems(caplog.records) == []
    leads = [r.getMessage() for r in caplog.records if " leads " in r.getMessage()]
    assert len(leads) <= 5, leads


async def test_a_node_killed_with_sigterm_at_4096_shards_drains_without_tracebacks(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    path = line_rules(tmp_path, f"lines_{namespace}",
                      RULES.format(ns=namespace, shards=4096, mod="{mod}"))
    log = tmp_path / "refreshes.log"
    procs = NodeProcs(tmp_path)
    try:
        proc = procs.start(path, own_server.url, "n1", E2E_LOG=str(log))
        keys = [f"stats:{i}" for i in range(1000)]
        async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as w:
            w.touch_many(keys)
            await w.flush()
        # A bound, not a timing: one node keeping 4,096 leases is slow on a loaded machine.
        await wait_until(lambda: {k for p, _, k, _, _ in read_lines(log) if p == "done"}
                         == set(keys), timeout=300, message="every key refreshed")
        await wait_until(lambda: "leads 4096 of 4096 shards" in procs.log("n1"), timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        procs.stop_all()
    text = procs.log("n1")
    for bad in ("Traceback", "Task was destroyed", "MaxConnectionsError", "ERROR"):
        assert bad not in text, text[-3000:]
    assert "leads 0 of 4096 shards" in text


class CountingClient:
    """A real client that counts round trips: single commands and pipeline executions."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.round_trips = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name == "pipeline":
            return self._counted_pipeline
        if callable(attr):
            async def call(*args: Any, **kwargs: Any) -> Any:
                self.round_trips += 1
                return await attr(*args, **kwargs)
            return call
        return attr

    def _counted_pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a: Any, **k: Any) -> Any:
            self.round_trips += 1
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe


STATUS_RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: a
    match: "a:{{id}}"
    handler: {mod}:refresh
  - name: b
    match: "b:{{id}}"
    handler: {mod}:fail
    retry: {{attempts: 1}}
"""


@pytest.mark.parametrize("shards", [1, 2048])
async def test_status_reads_in_a_few_round_trips_whatever_the_shard_count(
        shards: int, redis_url: str, namespace: str, tmp_path: Path) -> None:
    path = line_rules(tmp_path, f"lines_{namespace}",
                      STATUS_RULES.format(ns=namespace, shards=shards, mod="{mod}"))
    config = Config.from_yaml(path)
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as writer:
        writer.touch_many([f"a:{i}" for i in range(300)] + [f"b:{i}" for i in range(30)])
        await writer.flush()
    conn = await connect(redis_url)
    try:
        dead_key = "b:7"
        space = KeySpace(namespace, shards)
        shard = space.shard(space.shard_of(dead_key))
        await conn.client.zadd(shard.dead("b"), {dead_key: 1234})
        await conn.client.hset(shard.meta, dead_key, "D|1|1|1|RuntimeError: boom")
        counting = CountingClient(conn.client)
        status = await gather_status(counting, config)
    finally:
        await conn.close()
    # the shard layout, counts and leaders, the dead letters' state, recent history, the
    # rules registry and the server time it is read against, the sources' state, the
    # memory policy, the scheduled keys (a page of every shard)
    assert counting.round_trips <= 9
    assert len(status["shards"]) == shards
    assert status["rules"]["a"]["pending"] == 300
    assert status["rules"]["b"]["pending"] == 30
    assert status["rules"]["b"]["dead"] == 1
    assert status["dead_letters"] == [{"key": dead_key, "rule": "b", "since_ms": 1234,
                                       "attempts": 1, "error": "RuntimeError: boom"}]
    assert status["rules"]["a"]["next_due_ms"] is not None

