"""Poison messages of a Kafka source (a real Kafka-protocol broker, real nodes on a real
valkey-server): a message that cannot become a touch, whatever goes wrong reading it, is
rejected, counted, logged at most once a minute per kind, committed, and the next one
is read."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from bench.kafka_broker import TansuBroker
from coalescer.common.json_depth import MAX_DEPTH
from coalescer.sources import kafka_values
from coalescer.sources.kafka_values import MAX_VALUE_BYTES, MessageReader, Rejected
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import (  # noqa: F401 (nodes: a fixture)
    committed,
    load,
    new_topic,
    nodes,
    produce,
    refreshed_keys,
    sample,
    setup,
    until_equal,
)

GOOD = [{"orderId": n} for n in range(20)]
SOURCE = """\
sources:
  - name: orders
    type: kafka
    bootstrap: "h:1"
    topics: [orders]
    key: "order:{orderId}"
"""


def deep(levels: int) -> bytes:
    return b'{"orderId": 1, "x": ' + b"[" * levels + b"]" * levels + b"}"


def reader() -> MessageReader:
    config = load(SOURCE)
    (source,) = config.sources
    return MessageReader(source, config)  # type: ignore[arg-type]


def record(value: bytes, offset: int = 0) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic="orders", partition=0, offset=offset, timestamp=0,
                          timestamp_type=0, key=None, value=value, checksum=None,
                          serialized_key_size=0, serialized_value_size=len(value),
                          headers=())


@pytest.mark.parametrize("levels", [MAX_DEPTH, 10_000, 500_000])
def test_a_value_nested_too_deeply_is_rejected_naming_the_depth(levels: int) -> None:
    with pytest.raises(Rejected) as info:
        reader().touch_of(deep(levels))
    assert str(info.value) == (f"its value is JSON nested too deeply, more than {MAX_DEPTH} "
                               "levels deep (at offset 51)")


def test_a_value_nested_within_the_bound_is_read() -> None:
    assert reader().touch_of(deep(MAX_DEPTH - 1)) == ("order:1", None, None)


def test_a_value_over_the_size_limit_is_rejected_unread() -> None:
    with pytest.raises(Rejected, match=f"over the limit of {MAX_VALUE_BYTES}"):
        reader().touch_of(b'{"orderId": "' + b"[" * MAX_VALUE_BYTES + b'"}')


def test_any_error_reading_a_message_rejects_that_message_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = MessageReader.touch_of

    def touch_of(self: MessageReader, value: bytes | None) -> Any:
        if value and b"boom" in value:
            raise KeyError("boom")
        return real(self, value)

    monkeypatch.setattr(MessageReader, "touch_of", touch_of)
    touches = reader().touches([record(b'{"orderId": "boom"}', 0), record(b'{"orderId": 2}', 1),
                                record(b'{"orderId": "boom"}', 2)])
    assert touches.keys == ["order:2"]
    assert touches.rejected == [("orders", 0, offset, "it could not be read (KeyError: "
                                 "'boom')") for offset in (0, 2)]


# -- through a real broker --------------------------------------------------------------

async def test_a_deeply_nested_message_is_rejected_and_the_next_twenty_are_touched(
        *, tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, nodes: Any,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    topic = await new_topic(kafka)
    path, rec = setup(tmp_path, namespace, kafka, topic)
    caplog.set_level(logging.WARNING, logger="coalescer.sources")
    c = await nodes(path, redis_url, node_id="node-a")
    await produce(kafka, topic, [deep(100_000), *GOOD])
    await wait_until(lambda: refreshed_keys(rec) == {f"order:{n}" for n in range(20)},
                     timeout=20, message="all 20 good messages after the deep one")
    await until_equal(lambda: committed(kafka, topic), [21])  # past the deep one
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == 1)
    assert (await c.query.status())["sources"]["orders"]["rejected"] == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"message {topic}/0@0 rejected (committed, not touched)" in logged
    assert f"nested too deeply, more than {MAX_DEPTH} levels deep" in logged


async def test_a_message_whose_reading_raises_is_rejected_logged_once_and_committed(
        *, tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, nodes: Any,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = MessageReader.touch_of

    def touch_of(self: MessageReader, value: bytes | None) -> Any:
        if value and b"boom" in value:  # a fault no check foresaw
            raise RuntimeError("something no one foresaw")
        return real(self, value)

    monkeypatch.setattr(MessageReader, "touch_of", touch_of)
    topic = await new_topic(kafka)
    path, rec = setup(tmp_path, namespace, kafka, topic)
    caplog.set_level(logging.WARNING, logger=kafka_values.__name__)
    c = await nodes(path, redis_url, node_id="node-a")
    poison = [{"orderId": "boom", "n": n} for n in range(5)]
    await produce(kafka, topic, [*poison, *GOOD[:5], *poison, *GOOD[5:]])
    await wait_until(lambda: refreshed_keys(rec) == {f"order:{n}" for n in range(20)},
                     timeout=20, message="every good message, between the poison ones")
    await until_equal(lambda: committed(kafka, topic), [30])
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == 10)
    raised = [r.getMessage() for r in caplog.records
              if r.name == kafka_values.__name__ and "raised RuntimeError" in r.getMessage()]
    assert raised == [f"source orders: message {topic}/0@0 raised RuntimeError while being "
                      "read: something no one foresaw"]  # once a minute for the kind
