"""A Kafka source whose group gives no node a partition for longer than its
``stalled_after`` makes /healthz fail with the reason, and ``coalescer status`` says it.

A real coalescer node on the suite's valkey-server and a real Kafka-protocol broker
(Tansu, the suite's ``kafka`` fixture): the broker answers, but another member of the
group, its leader, keeps every partition (its assignor gives the node none), so the
deployment never reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.config.rules import Config
from coalescer.query.source_status import format_sources
from coalescer.web.api import HttpApi
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import new_topic


class Greedy(RoundRobinPartitionAssignor):  # type: ignore[misc]
    """Round-robin by name, but the leader ("greedy-...") keeps every partition."""

    @classmethod
    def assign(cls, cluster: Any, members: Any) -> dict[str, Any]:
        spread = super().assign(cluster, members)
        mine: dict[str, list[int]] = {}
        for assignment in spread.values():
            for topic, partitions in assignment.assignment:
                mine.setdefault(topic, []).extend(partitions)
        return {member: ConsumerProtocolMemberAssignment(
            cls.version, sorted(mine.items()) if member.startswith("greedy") else [], b"")
            for member in spread}

RULES = """\
namespace: {ns}
rules:
  - name: order
    match: "order:{{id}}"
    handler: {{mod}}:refresh
sources:
  - name: orders
    type: kafka
    bootstrap: "{bootstrap}"
    topics: [{topic}]
    stalled_after: {stalled_after}
    key: "order:{{orderId}}"
"""


def test_stalled_after_is_read_and_defaults_to_a_minute() -> None:
    text = RULES.format(ns="n", bootstrap="127.0.0.1:9092", topic="orders",
                        stalled_after="5s").replace("{mod}:refresh", "builtins:repr")
    (source,) = Config.from_string(text, source="rules.yaml").sources
    assert getattr(source, "stalled_after") == 5.0  # noqa: B009
    plain = text.replace("    stalled_after: 5s\n", "")
    (source,) = Config.from_string(plain, source="rules.yaml").sources
    assert getattr(source, "stalled_after") == 60.0  # noqa: B009


@pytest.mark.slow  # the group rebalances as the node joins (Tansu takes seconds)
async def test_a_source_whose_group_never_gets_a_partition_fails_healthz(
        tmp_path: Path, namespace: str, redis_url: str, kafka: TansuBroker,
        start: Start) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, rec = recorder_rules(tmp_path, f"stalled_{namespace}", RULES.format(
        ns=namespace, bootstrap=kafka.bootstrap, topic=topic, stalled_after="1s"))
    greedy = AIOKafkaConsumer(topic, bootstrap_servers=kafka.bootstrap,
                              group_id=f"coalescer.{namespace}.orders", client_id="greedy",
                              partition_assignment_strategy=(Greedy,),
                              enable_auto_commit=False, heartbeat_interval_ms=500)
    await greedy.start()
    try:
        await wait_until(lambda: _joined(greedy), timeout=20, message="the leader joined")
        c = await start(path, redis_url=redis_url, node_id="node-a")
        await _stalled(c, namespace, topic, greedy)
        assert rec.calls == []
    finally:
        await greedy.stop()


async def _joined(member: AIOKafkaConsumer) -> bool:
    await member.getmany(timeout_ms=50)  # the group's join goes on while it polls
    return bool(member.assignment())


async def _stalled(c: Coalescer, namespace: str, topic: str,
                   greedy: AIOKafkaConsumer) -> None:
    why = (f"no node has held a partition of {topic} in group "
           f"'coalescer.{namespace}.orders' for over 1s (do the topics exist, with "
           "partitions?)")

    async def problems() -> list[str]:
        await greedy.getmany(timeout_ms=50)  # the leader stays in the group
        return c.health_problems()

    await wait_until(lambda: _has(problems(), f"Kafka source 'orders': {why}"), timeout=30,
                     message="the stall among the node's health problems")
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(api.url + "/healthz") as reply:
            assert reply.status == 503
            assert f"Kafka source 'orders': {why}" in (await reply.json())["reasons"]
    finally:
        await api.close()

    async def shown() -> bool:
        status = await c.query.status()
        return bool(status["sources"]["orders"]["errors"].get("node-a") == why)

    await wait_until(shown, timeout=10, message="the stall in coalescer status")
    lines = format_sources(await c.query.status())
    assert f"{'':<24} error on node-a: {why}" in lines


async def _has(found: Any, expected: str) -> bool:
    return expected in await found
