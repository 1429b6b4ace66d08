"""A Kafka source whose messages carry a time (``delay:``) stays inside
``limits.pending_keys``: past it, its messages are rejected (counted, committed), never
touched; on the suite's real Kafka-protocol broker and a real valkey-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import (
    committed,
    new_topic,
    nodes,
    produce,
    sample,
    setup,
    until_equal,
)

__all__ = ["nodes"]  # the fixture, used by name


def counted(c: Coalescer) -> int | None:
    quota = c._run.quota
    return None if quota is None else quota.pending


async def test_a_delay_topic_cannot_push_pending_keys_past_the_limit(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        redis_client: Any, *, nodes: Any) -> None:
    topic = await new_topic(kafka)
    path, _ = setup(tmp_path, namespace, kafka, topic, extra='    delay: "{delayTime}m"\n')
    path.write_text(path.read_text()
                    .replace("claim_lease: 1s\n", "claim_lease: 1s\nlimits: {pending_keys: 5}\n")
                    .replace("window: 50ms", "window: 1h\n  max_wait: 1h"))
    c = await nodes(path, redis_url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": f"a{n}", "delayTime": 30} for n in range(5)])
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="accepted") == 5, timeout=15)
    await wait_until(lambda: counted(c) == 5, message="a count of the 5 pending keys")
    await produce(kafka, topic, [{"orderId": f"b{n}", "delayTime": 30} for n in range(20)])
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == 20, timeout=15,
                     message="the 20 messages past the limit rejected")
    assert sample(c, "coalescer_source_entries_total", outcome="accepted") == 5
    await until_equal(lambda: committed(kafka, topic), [25])
    assert await redis_client.zcard(KeySpace(namespace, 1).shard(0).due("order")) == 5
