"""A worker's ``await coalescer.drain()`` waits for its running Kafka source to read.

A worker coalescer (its Kafka source running, a member of the group) on the suite's
valkey-server and a real Kafka-protocol broker (Tansu, the suite's ``kafka`` fixture;
skipped where its binary is absent). Marked slow: the group's first rebalance takes
seconds, which the first drain waits for.
"""

from __future__ import annotations

from pathlib import Path

from bench.kafka_broker import TansuBroker
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules
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
