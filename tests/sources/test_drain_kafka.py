"""``await coalescer.drain()`` reads a Kafka source's messages before it runs what is pending.

A writer coalescer (``worker=False``) on the suite's valkey-server and a real
Kafka-protocol broker (Tansu, the suite's ``kafka`` fixture; skipped where its binary
is absent), producing with aiokafka as an application would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kafka_broker import TansuBroker
from coalescer import SourceReadError
from tests.conftest import Start
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import free_port
from tests.sources.test_kafka import committed, new_topic, produce

RULES = """\
namespace: {ns}
rules:
  - name: order
    match: "order:{{id}}"
    window: 1h
    max_wait: 2h
    handler: {{mod}}:refresh
sources:
  - name: orders
    type: kafka
    bootstrap: "{bootstrap}"
    topics: [{topic}]
    group: "g-{topic}"
    start: earliest
    key: "order:{{orderId}}"
"""


async def test_drain_reads_the_messages_up_to_the_end_offsets_and_commits_them(
        tmp_path: Path, namespace: str, redis_url: str, start: Start,
        kafka: TansuBroker) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, rec = recorder_rules(tmp_path, f"drain_kafka_{namespace}", RULES.format(
        ns=namespace, bootstrap=kafka.bootstrap, topic=topic))
    await produce(kafka, topic, [{"orderId": 1}, {"orderId": 2}], partition=0)
    await produce(kafka, topic, [{"orderId": 1}, b"not json", {"orderId": 3}], partition=1)
    c = await start(path, redis_url=redis_url, worker=False)

    claims = await c.drain(timeout=30)

    assert sorted(claim.key for claim in claims) == ["order:1", "order:2", "order:3"]
    assert len(rec.calls) == 3
    own = f"coalescer.{namespace}.orders"  # a drain's group, whatever the rules name
    assert await committed(kafka, topic, partitions=2, group=own) == [2, 3]  # poison too
    assert await committed(kafka, topic, partitions=2) == [None, None]  # the named one's
    assert await c.drain(timeout=30) == []  # committed: never read twice


async def test_a_broker_that_cannot_be_reached_fails_the_drain_naming_the_source(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    path, rec = recorder_rules(tmp_path, f"drain_kafka_{namespace}", RULES.format(
        ns=namespace, bootstrap=bootstrap, topic="orders"))
    c = await start(path, redis_url=redis_url, worker=False)

    with pytest.raises(SourceReadError) as info:
        await c.drain(timeout=10)

    assert info.value.source == "orders"
    assert f"source 'orders' (Kafka topics orders at {bootstrap})" in str(info.value)
    assert rec.calls == []
