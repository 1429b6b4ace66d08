"""A Kafka batch whose flush times out (Redis answers nothing for longer than the flush
may wait) leaves no task with an exception nobody retrieved: the batch is read again
once Redis answers, and the log says what happened in one line.

A real coalescer node, a valkey-server of the test's own (frozen with SIGSTOP) and a
real Kafka-protocol broker (Tansu, the suite's ``kafka`` fixture).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest

from bench.kafka_broker import TansuBroker
from tests.conftest import Start
from tests.helpers.servers import ValkeyProcess, freeze, thaw, wait_until
from tests.sources.test_kafka import new_topic, produce, refreshed_keys, sample, setup


@pytest.mark.slow  # Redis stays frozen past the flush's 10 s
async def test_a_flush_that_times_out_leaves_no_unretrieved_task(
        tmp_path: Path, namespace: str, kafka: TansuBroker, own_server: ValkeyProcess,
        start: Start, *, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    topic = await new_topic(kafka)
    path, rec = setup(tmp_path, namespace, kafka, topic)
    c = await start(path, redis_url=own_server.url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": "first"}])
    await wait_until(lambda: refreshed_keys(rec) == {"order:first"}, timeout=30)
    freeze(own_server)
    try:
        await produce(kafka, topic, [{"orderId": n} for n in range(5)])
        await wait_until(lambda: sample(c, "coalescer_kafka_errors_total") >= 1, timeout=30,
                         message="the flush timed out")
    finally:
        thaw(own_server)
    await wait_until(lambda: refreshed_keys(rec) >= {f"order:{n}" for n in range(5)},
                     timeout=60, message="the batch read again and run")
    gc.collect()  # an unretrieved task's exception is logged when the task is collected
    never = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert never == []
    said = [r.getMessage() for r in caplog.records if r.name == "coalescer.sources.kafka"]
    assert any("Redis did not take the batch's touches within 10s; the batch is not "
               "committed and is read again" in line for line in said)
