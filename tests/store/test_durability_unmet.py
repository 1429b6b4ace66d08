"""A node that cannot meet ``durability: {replicas: 1}`` (its primary lost its only
replica) says so where an operator looks: ``/healthz`` 503 with the reason, status
(text and JSON), the metric, one log line; it keeps leading its shard meanwhile, and
all of it clears once a replica is back. A real primary and replica, started here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coalescer import Coalescer
from coalescer.errors import ReplicationError
from coalescer.query.status import format_status
from coalescer.web.api import HttpApi
from tests.helpers.servers import ValkeyProcess, replica_of, wait_until
from tests.store.test_replication import rules
from tests.worker.test_rolling import ITEM, ONLY_A, Node, RulesFactory, text

REASON = ("waiting for 1 replica: the primary has 0 connected replicas; add a replica or "
          "lower durability.replicas")


def unmet(c: Coalescer) -> float | None:
    return c.metrics.registry.get_sample_value("coalescer_durability_unmet")


async def healthz(http: aiohttp.ClientSession, api: HttpApi) -> tuple[int, dict[str, Any]]:
    async with http.get(f"http://127.0.0.1:{api.port}/healthz") as response:
        return response.status, await response.json()


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def wait_calls(server: ValkeyProcess) -> int:
    """How many WAIT commands ``server`` has answered."""
    with server.client() as client:
        return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ValkeyProcess]]:
    """A primary (first), then the replicas a test starts: all stopped at the end."""
    started = [ValkeyProcess(dir=tmp_path / "primary")]
    yield started
    for server in reversed(started):
        server.stop()


async def test_a_primary_left_without_its_replica_is_reported_everywhere_until_one_is_back(
        tmp_path: Path, namespace: str, servers: list[ValkeyProcess],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer.store.replicas")
    caplog.set_level(logging.DEBUG, logger="coalescer.worker.poller")  # the handler's too
    primary = servers[0]
    replica = replica_of(primary, tmp_path / "replica")
    servers.append(replica)
    path, rec = rules(tmp_path, namespace, "durability: {replicas: 1, timeout: 200ms}")
    async with Coalescer.from_yaml(path, redis_url=primary.url, node_id="n1") as c, \
            HttpApi(c, port=0) as api, aiohttp.ClientSession() as http:
        c.touch("item:1")
        await c.flush()
        await wait_until(lambda: rec.of("item:1"), message="item:1 refreshed")
        assert unmet(c) == 0
        assert (await healthz(http, api))[0] == 200
        assert (await c.query.status())["durability"]["unmet"] is False

        await asyncio.to_thread(replica.stop)  # the primary is left without a replica
        c.touch("item:2")
        with pytest.raises(ReplicationError):
            await c.flush()  # kept, and written again
        await wait_until(lambda: unmet(c) == 1, message="the metric says durability is unmet")
        waits = wait_calls(primary)
        await wait_until(lambda: wait_calls(primary) >= waits + 6,
                         message="a few more writes and claims refused for their WAIT")
        assert said(caplog, "claim not confirmed by the replicas")
        code, body = await healthz(http, api)
        assert code == 503 and REASON in body["reasons"]
        status = await c.query.status()
        assert status["durability"]["unmet"] is True
        assert status["durability"]["problem"] == REASON
        assert list(status["durability"]["connected"].values()) == [0]
        assert f"WARNING: durability unmet: {REASON}" in format_status(
            status, int(time.time() * 1000))
        [warning] = said(caplog, "durability unmet")
        assert warning.levelno == logging.WARNING and REASON in warning.getMessage()
        assert c.leads() == [0]  # no claim refused for its WAIT cost the node its shard
        assert said(caplog, "leads 0 of") == []
        assert said(caplog, "leadership rounds") == []
        assert rec.of("item:2") == []

        servers.append(await asyncio.to_thread(replica_of, primary, tmp_path / "replica-2"))
        await wait_until(lambda: rec.of("item:2"), timeout=20,
                         message="item:2 refreshed once a replica is back")
        await wait_until(lambda: unmet(c) == 0, message="the metric cleared")
        assert (await healthz(http, api))[0] == 200
        assert (await c.query.status())["durability"]["problem"] is None
        assert len(said(caplog, "durability met again")) == 1
        assert len(said(caplog, "durability unmet")) == 1


@pytest.mark.slow
async def test_a_node_adopting_a_rule_keeps_serving_it_through_claims_left_unconfirmed(
        tmp_path: Path, namespace: str, servers: list[ValkeyProcess],
        rules_file: RulesFactory, caplog: pytest.LogCaptureFixture) -> None:
    """B leads and lacks ``only-a``; A adopts it (a rolling deploy). With the replica
    gone, A's adopted claims are given back and tried again; A never fails its rounds."""
    caplog.set_level(logging.DEBUG, logger="coalescer.worker.adopter")
    primary = servers[0]
    servers.append(await asyncio.to_thread(replica_of, primary, tmp_path / "replica"))
    durable = "leader_lease: 1s\ndurability: {replicas: 1, timeout: 200ms}"
    node_b = Node(rules_file, text(namespace, 1, ITEM).replace("leader_lease: 1s", durable))
    node_a = Node(rules_file, text(namespace, 1, ITEM, ONLY_A).replace("leader_lease: 1s",
                                                                          durable))
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(
            Coalescer(node_b.config, redis_url=primary.url, node_id="B"))
        await wait_until(lambda: b.leads() == [0], message="B leads")
        a = await stack.enter_async_context(
            Coalescer(node_a.config, redis_url=primary.url, node_id="A"))
        a.touch("a:1")
        await a.flush()
        await wait_until(lambda: node_a.rec.of("a:1"), message="A adopts only-a")

        await asyncio.to_thread(servers[1].stop)
        a.touch("a:2")
        with pytest.raises(ReplicationError):
            await a.flush()
        waits = wait_calls(primary)
        await wait_until(lambda: wait_calls(primary) >= waits + 8,
                         message="a few more writes and claims refused for their WAIT")
        assert said(caplog, "adopted claim not confirmed by the replicas")
        assert said(caplog, "leadership rounds") == []
        assert node_a.rec.of("a:2") == []

        servers.append(await asyncio.to_thread(replica_of, primary, tmp_path / "replica-2"))
        await wait_until(lambda: node_a.rec.of("a:2"), timeout=20,
                         message="a:2 refreshed by A once a replica is back")
