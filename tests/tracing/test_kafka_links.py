"""Tracing through the Kafka source: a message's ``traceparent`` header (its producer's
W3C trace context) is kept with the key it touches, and the refresh links to it (a real
Kafka-protocol broker, the SDK's in-memory exporter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.kafka_broker import TansuBroker
from tests.sources.test_kafka import new_topic, nodes, setup  # noqa: F401 (nodes: a fixture)
from tests.tracing.test_refresh_spans import exporter, ids, linked, refresh_spans  # noqa: F401


async def test_a_kafka_message_carries_its_producers_context_in_a_header(
        *, exporter: InMemorySpanExporter, kafka: TansuBroker, namespace: str,  # noqa: F811
        redis_url: str, tmp_path: Path, nodes: Any) -> None:  # noqa: F811
    topic = await new_topic(kafka)
    path, _ = setup(tmp_path, namespace, kafka, topic)
    await nodes(path, redis_url)
    with trace.get_tracer("app").start_as_current_span("publish") as span:
        producer_ctx = span.get_span_context()
    sent = f"00-{producer_ctx.trace_id:032x}-{producer_ctx.span_id:016x}-01"
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()
    try:
        await producer.send(topic, json.dumps({"orderId": 7}).encode(),
                            headers=[("traceparent", sent.encode())])
        await producer.send(topic, json.dumps({"orderId": 7}).encode())
        await producer.flush()
    finally:
        await producer.stop()
    [refresh] = await refresh_spans(exporter, 1)
    assert dict(refresh.attributes or {})["coalescer.key"] == "order:7"
    assert linked(refresh) == [ids(producer_ctx)]
