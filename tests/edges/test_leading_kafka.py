"""``edge: leading`` through a Kafka source, on a node on a real server and the suite's
real Kafka-protocol broker: a message for a quiet key refreshes it at once with its
item; messages read while that refresh runs make exactly one more, with theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.kafka_broker import TansuBroker
from tests.conftest import Start
from tests.edges.test_leading_edge import quiet_down
from tests.helpers.e2e import recorder_rules, server_ms
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import committed, new_topic, produce, until_equal

WINDOW_MS = 2000

RULES = """\
namespace: {ns}
claim_lease: 5s
defaults:
  absorb: 5ms
rules:
  - name: lead
    match: "lead:{{id}}"
    window: 2s
    max_wait: 4s
    edge: leading
    items: {{max: 100}}
    handler: {{mod}}:refresh
sources:
  - name: orders
    type: kafka
    bootstrap: "{bootstrap}"
    topics: [{topic}]
    group: "g-{topic}"
    start: earliest
    key: "lead:{{customer}}"
    item: "{{order}}"
"""


@pytest.mark.slow  # some 7-10 s: with the long scenarios, out of the quick run
async def test_kafka_messages_lead_at_once_and_those_during_the_run_make_one_more(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        *, redis_client: Any, start: Start) -> None:
    topic = await new_topic(kafka)
    text = RULES.format(ns=namespace, bootstrap=kafka.bootstrap, topic=topic)
    path, rec = recorder_rules(tmp_path, f"leadkafka_{namespace}", text)
    rec.clock = lambda: server_ms(redis_client)
    gate = rec.hold_first()
    c = await start(path, redis_url=redis_url, node_id="n1")
    assert c.config.rule_for("lead:7").leading
    await produce(kafka, topic, [{"customer": "7", "order": "a"}])
    await wait_until(lambda: len(rec.calls) == 1, timeout=15,
                     message="the leading refresh running")
    first = rec.calls[0]
    assert first.due_ms == first.first_touch_ms  # due at its first touch, not a window on
    assert list(first.items) == ["a"]

    await produce(kafka, topic, [{"customer": "7", "order": "b"},
                                 {"customer": "7", "order": "c"}])
    # a source commits its offsets once Redis holds the touches: both are written
    await until_equal(lambda: committed(kafka, topic), [3], message="both touched")
    gate.set()
    await quiet_down(redis_client, namespace)
    assert len(rec.of("lead:7")) == 2  # exactly one more
    second = rec.of("lead:7")[1]
    assert sorted(second.items) == ["b", "c"]
    assert second.due_ms >= second.last_touch_ms + WINDOW_MS  # a trailing refresh
    assert rec.start_ms[1] >= second.due_ms
