"""``await coalescer.drain()`` and a Kafka group with members: a worker's drain waits for
its running Kafka source to read; a writer's drain beside a member elsewhere.

Coalescers on the suite's valkey-server and a real Kafka-protocol broker (Tansu, the
suite's ``kafka`` fixture; skipped where its binary is absent). Marked slow: a group's
first rebalance takes seconds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from bench.kafka_broker import TansuBroker
from coalescer.sources.kafka_commit import CAUSES
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until
from tests.sources.test_drain_kafka import RULES
from tests.sources.test_kafka import committed, new_topic, produce


async def test_a_workers_drain_runs_every_message_its_running_source_reads_once(
        tmp_path: Path, namespace: str, redis_url: str, start: Start,
        kafka: TansuBroker) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, rec = recorder_rules(tmp_path, f"drain_kafka_worker_{namespace}", RULES.format(
        ns=namespace, bootstrap=kafka.bootstrap, topic=topic))
    c = await start(path, redis_url=redis_url, worker=True)
    await produce(kafka, topic, [{"orderId": 1}, {"orderId": 2}], partition=0)

    claims = await c.drain(timeout=30)  # the group gives the node its partitions first

    assert sorted(claim.key for claim in claims) == ["order:1", "order:2"]
    await produce(kafka, topic, [{"orderId": 3}, b"not json"], partition=1)
    assert [claim.key for claim in await c.drain(timeout=30)] == ["order:3"]
    assert await committed(kafka, topic, partitions=2) == [2, 2]
    assert await c.drain(timeout=30) == []
    assert sorted(claim.key for claim in rec.calls) == ["order:1", "order:2", "order:3"]


async def joined(member: AIOKafkaConsumer) -> bool:
    await member.getmany(timeout_ms=50)  # the group's join goes on while it polls
    return bool(member.assignment())


async def test_a_writers_drain_beside_a_member_of_the_group_leaves_it_the_offsets(
        tmp_path: Path, redis_url: str, start: Start, kafka: TansuBroker,
        caplog: pytest.LogCaptureFixture) -> None:
    topic = await new_topic(kafka)
    namespace = "n" + topic.removeprefix("t-")  # the topic's name is new each time
    path, _ = recorder_rules(tmp_path, f"drain_kafka_member_{namespace}", RULES.format(
        ns=namespace, bootstrap=kafka.bootstrap, topic=topic))
    group = f"coalescer.{namespace}.orders"  # the group a drain of this namespace reads in
    member = AIOKafkaConsumer(topic, bootstrap_servers=kafka.bootstrap, group_id=group,
                              enable_auto_commit=False, heartbeat_interval_ms=1000)
    await member.start()
    try:
        await wait_until(lambda: joined(member), timeout=20, message="the member joined")
        await produce(kafka, topic, [{"orderId": 1}])
        c = await start(path, redis_url=redis_url, worker=False)
        with caplog.at_level(logging.WARNING, logger="coalescer.sources.kafka"):
            claims = await c.drain(timeout=30)
            await c.drain(timeout=30)  # its commit is refused once more
        assert [claim.key for claim in claims] == ["order:1"]  # touched all the same
        # one line, naming the refusal and its cause, however often it is refused
        (line,) = [r.getMessage() for r in caplog.records if "ommit" in r.getMessage()]
        assert line.startswith(f"source orders: commit refused by group '{group}': ")
        assert any(cause in line for cause in CAUSES.values())
        assert "the group's members read them again" in line
        assert "max_poll_interval" not in line and "\n" not in line
        assert await committed(kafka, topic, group=group) == [None]  # the member's to commit
    finally:
        await member.stop()
