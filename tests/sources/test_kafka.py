"""Kafka sources: messages of Kafka topics become touches, committed once in Redis.

The rules-file part is checked without a broker; everything else runs real coalescer
nodes on real valkey-servers and a real Kafka-protocol broker (Tansu, started by the
suite's ``kafka`` fixture; skipped where its binary is absent), producing with aiokafka
as an application would, and checks what a user would: which keys were refreshed, the
group's committed offsets (read from the broker), what `coalescer status`, /healthz and
the metrics say. Tansu keeps its messages in memory only, so no test restarts it.
"""

from __future__ import annotations

import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.config.rules import Config, check_file
from coalescer.errors import ConfigError
from coalescer.query.source_status import format_sources
from coalescer.sources.kafka import check_kafka
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from tests.helpers.e2e import (
    NodeProcs,
    Recorder,
    line_rules,
    read_lines,
    recorder_rules,
    server_ms,
)
from tests.helpers.servers import ValkeyProcess, freeze, thaw, wait_until

# -- the rules file ---------------------------------------------------------------------

BASE = """\
rules:
  - name: order
    match: "order:{id}"
    handler: builtins:repr
"""


def load(sources: str) -> Config:
    return Config.from_string(BASE + sources, source="rules.yaml")


def test_a_kafka_source_gets_its_defaults() -> None:
    config = load("""\
sources:
  - name: orders
    type: kafka
    bootstrap: "${KAFKA_BOOTSTRAP}"
    topics: [orders, refunds]
    key: "order:{orderId}"
""")
    (source,) = config.sources
    assert (source.type, source.topics, source.group, source.start, source.batch) == (
        "kafka", ("orders", "refunds"), "", "latest", 5000)  # "": named by the namespace
    assert source.resolved_bootstrap({"KAFKA_BOOTSTRAP": "10.0.0.1:9092"}) == "10.0.0.1:9092"
    assert source.line == 6


@pytest.mark.parametrize(("block", "field", "words"), [
    ("    topics: [orders]\n    key: 'order:{id}'\n", "sources[0].bootstrap",
     "missing the required field 'bootstrap'"),
    ("    bootstrap: localhost\n    topics: [orders]\n    key: 'order:{id}'\n",
     "sources[0].bootstrap", "not host:port"),
    ("    bootstrap: 'h:1'\n    topics: []\n    key: 'order:{id}'\n", "sources[0].topics",
     "non-empty list"),
    ("    bootstrap: 'h:1'\n    topics: ['a b']\n    key: 'order:{id}'\n",
     "sources[0].topics[0]", "not a Kafka topic name"),
    ("    bootstrap: 'h:1'\n    topics: [o]\n    start: new\n    key: 'order:{id}'\n",
     "sources[0].start", "'earliest'"),
    ("    bootstrap: 'h:1'\n    topics: [o]\n    key: 'user:{id}'\n", "sources[0].key",
     "can never match a rule"),
    ("    bootstrap: 'h:1'\n    topics: [o]\n    key: 'order:{id}'\n    batch: 0\n",
     "sources[0].batch", "positive whole number"),
    ("    bootstrap: 'h:1'\n    topics: [o]\n    key: 'order:{id}'\n    stream: s\n",
     "sources[0].stream", "not a field of a kafka source"),
])
def test_bad_kafka_sources_name_file_line_and_field(block: str, field: str,
                                                    words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load("sources:\n  - name: orders\n    type: kafka\n" + block)
    assert caught.value.file == "rules.yaml"
    assert caught.value.field == field
    assert words in str(caught.value)
    assert caught.value.line is not None and caught.value.line >= 5


def test_a_node_refuses_a_bootstrap_it_cannot_resolve() -> None:
    config = load("""\
sources:
  - name: orders
    type: kafka
    bootstrap: "${KAFKA_HOST}:9092"
    topics: [orders]
    key: "order:{orderId}"
""")
    (source,) = config.sources
    (missing,) = check_kafka(source, 0, config, {})
    assert (missing.file, missing.line, missing.field) == ("rules.yaml", 6,
                                                          "sources[0].bootstrap")
    assert "environment variable KAFKA_HOST, which is not set" in str(missing)
    (bad,) = check_kafka(source, 0, config, {"KAFKA_HOST": "a:1,b c"})
    assert "'b c:9092' is not host:port" in str(bad)
    assert check_kafka(source, 0, config, {"KAFKA_HOST": "10.0.0.1"}) == []


def test_check_warns_of_a_bootstrap_variable_not_set_here(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(BASE + """\
sources:
  - name: orders
    type: kafka
    bootstrap: "${KAFKA_BOOTSTRAP}"
    topics: [orders]
    key: "order:{orderId}"
""")
    (warning,) = check_file(path, {}, import_handlers=False).warnings
    assert (warning.line, warning.field) == (6, "sources[0].bootstrap")
    assert "KAFKA_BOOTSTRAP is not set (or empty) here" in warning.message
    assert "takes its bootstrap from it" in warning.message
    assert check_file(path, {"KAFKA_BOOTSTRAP": "h:1"}, import_handlers=False).warnings == ()


# -- helpers ----------------------------------------------------------------------------

RULES = """\
namespace: {ns}
claim_lease: 1s
defaults:
  window: 50ms
  absorb: 5ms
rules:
  - name: order
    match: "order:{{id}}"
    handler: {{mod}}:refresh
sources:
  - name: orders
    type: kafka
    bootstrap: "{bootstrap}"
    topics: [{topic}]
    group: "g-{topic}"
    start: earliest
    key: "order:{{orderId}}"
{extra}"""


async def new_topic(broker: TansuBroker, partitions: int = 1, name: str | None = None) -> str:
    topic = name or f"t-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                            replication_factor=1)])
    finally:
        await admin.close()
    return topic


async def produce(broker: TansuBroker, topic: str, values: list[Any],
                  partition: int | None = None) -> None:
    """Publish each value (bytes as they are, anything else as JSON), in order."""
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
    await producer.start()
    try:
        for n, value in enumerate(values):
            raw = value if isinstance(value, bytes) else json.dumps(value).encode()
            await producer.send(topic, raw, key=str(n).encode(), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


async def committed(broker: TansuBroker, topic: str, partitions: int = 1,
                    group: str | None = None) -> list[int | None]:
    """The committed offset of each partition of ``topic`` in ``group`` (default: its
    source's group as the rules name it, each test's own), read from the broker."""
    consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap,
                                group_id=group or f"g-{topic}", enable_auto_commit=False)
    await consumer.start()
    try:
        return [await consumer.committed(TopicPartition(topic, p)) for p in range(partitions)]
    finally:
        await consumer.stop()


async def total_committed(broker: TansuBroker, topic: str, partitions: int) -> int:
    return sum(offset or 0 for offset in await committed(broker, topic, partitions))


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[Any]:
    """nodes(rules_path, redis_url, **options) -> a started Coalescer, closed at teardown."""
    async with AsyncExitStack() as stack:
        async def make(path: Path, url: str, **options: Any) -> Coalescer:
            options.setdefault("grace", 2.0)
            c = Coalescer.from_yaml(path, redis_url=url, **options)
            await stack.enter_async_context(c)
            return c

        yield make


def setup(tmp_path: Path, namespace: str, broker: TansuBroker, topic: str, *,
          extra: str = "", bootstrap: str | None = None) -> tuple[Path, Recorder]:
    text = RULES.format(ns=namespace, bootstrap=bootstrap or broker.bootstrap, topic=topic,
                        extra=extra)
    return recorder_rules(tmp_path, f"rec_{namespace}", text)


def sample(c: Coalescer, name: str, **labels: str) -> float:
    value = c.metrics.registry.get_sample_value(name, {"source": "orders", **labels})
    return value or 0.0


async def until_equal(read: Callable[[], Any], expected: Any, timeout: float = 15.0,
                      message: str | None = None) -> None:
    """Poll ``read()`` (sync or async) until it equals ``expected``."""
    seen: list[Any] = []

    async def equal() -> bool:
        value = read()
        value = await value if inspect.isawaitable(value) else value
        seen[:] = [value]
        return bool(value == expected)

    try:
        await wait_until(equal, timeout=timeout, interval=0.1, message=message)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: expected {expected!r}, last read {seen!r}") from None


async def due(redis: Any, namespace: str, key: str) -> states.Pending | None:
    value = await redis.hget(KeySpace(namespace, 1).shard(0).meta, key)
    return None if value is None else states.pending(value)


def refreshed_keys(rec: Recorder) -> set[str]:
    return {claim.key for claim in rec.calls}


# -- messages become touches ------------------------------------------------------------

async def test_offsets_are_committed_only_once_redis_holds_the_touches(
        tmp_path: Path, namespace: str, kafka: TansuBroker, own_server: ValkeyProcess,
        nodes: Any) -> None:
    topic = await new_topic(kafka)
    path, rec = setup(tmp_path, namespace, kafka, topic)
    c = await nodes(path, own_server.url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": n} for n in range(3)])
    await wait_until(lambda: refreshed_keys(rec) == {"order:0", "order:1", "order:2"},
                     timeout=15)
    await until_equal(lambda: committed(kafka, topic), [3])

    own_server.stop()  # Redis is gone: the next batch cannot be flushed
    await produce(kafka, topic, [{"orderId": n} for n in range(3, 8)])
    await wait_until(lambda: sample(c, "coalescer_kafka_unflushed_peak_messages") >= 5,
                     message="the batch read while Redis is down")
    await wait_until(lambda: sample(c, "coalescer_kafka_errors_total") >= 1, timeout=20,
                     message="the flush given up")
    assert await committed(kafka, topic) == [3]  # read, not in Redis: not committed

    own_server.start()
    await wait_until(lambda: {f"order:{n}" for n in range(3, 8)} <= refreshed_keys(rec),
                     timeout=20, message="the batch read again and touched")
    await until_equal(lambda: committed(kafka, topic), [8], timeout=20)


async def test_poison_messages_are_counted_committed_and_never_block(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        nodes: Any) -> None:
    topic = await new_topic(kafka)
    path, rec = setup(tmp_path, namespace, kafka, topic)
    # the last kind of poison: a message whose key no rule matches
    path.write_text(path.read_text().replace('key: "order:{orderId}"',
                                             'key: "{kind}:{orderId}"'))
    c = await nodes(path, redis_url, node_id="node-a")
    poison: list[Any] = [b"not json", b"\xff\xfe", [1, 2], "text", {"kind": "order"},
                         *[{"kind": "order", "orderId": bad}
                           for bad in (None, {"x": 1}, True, "a:b", "x" * 20_000)],
                         {"kind": "user", "orderId": "ok"}]
    await produce(kafka, topic, [{"kind": "order", "orderId": "first"}, *poison,
                                 {"kind": "order", "orderId": "last"}])
    await wait_until(lambda: refreshed_keys(rec) == {"order:first", "order:last"},
                     timeout=15)
    await until_equal(lambda: committed(kafka, topic), [len(poison) + 2])
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == len(poison))
    status = (await c.query.status())["sources"]["orders"]
    assert status["rejected"] == len(poison)
    assert (status["type"], status["topics"], status["group"]) == ("kafka", [topic],
                                                                   f"g-{topic}")


async def test_a_node_holds_at_most_batch_unflushed_messages(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        nodes: Any) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, rec = setup(tmp_path, namespace, kafka, topic, extra="    batch: 50\n")
    await produce(kafka, topic, [{"orderId": n % 100} for n in range(2000)])
    c = await nodes(path, redis_url)
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="accepted") == 2000, timeout=20)
    assert sample(c, "coalescer_kafka_unflushed_peak_messages") == 50  # full batches, no more
    await wait_until(lambda: len(refreshed_keys(rec)) == 100, timeout=15)
    await until_equal(lambda: total_committed(kafka, topic, 2), 2000)


async def test_status_shows_each_partitions_lag_and_the_page_lines(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        nodes: Any) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, _ = setup(tmp_path, namespace, kafka, topic)
    c = await nodes(path, redis_url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": n} for n in range(10)], partition=1)

    async def partitions() -> Any:
        found = (await c.query.status())["sources"]["orders"]["partitions"]
        return found.get(f"{topic}/1", {}).get("committed") == 10 and found

    found = await wait_until(partitions, timeout=15)
    assert found[f"{topic}/1"] == {"node": "node-a", "committed": 10, "end": 10, "lag": 0}
    status = await c.query.status()
    assert status["sources"]["orders"]["errors"] == {}
    lines = "\n".join(format_sources(status))
    assert f"{topic}/1" in lines and "orders" in lines
    assert sample(c, "coalescer_kafka_lag_messages", topic=topic, partition="1") == 0


async def test_a_broker_that_is_down_is_shown_and_then_read(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        nodes: Any) -> None:
    down = TansuBroker(kafka.binary, tmp_path)  # its port: nothing listens there yet
    path, rec = setup(tmp_path, namespace, kafka, "orders", bootstrap=down.bootstrap)
    c = await nodes(path, redis_url, node_id="node-a")

    async def error() -> Any:
        return (await c.query.status())["sources"]["orders"]["errors"].get("node-a")

    assert "Unable to bootstrap" in str(await wait_until(error, timeout=20))
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(api.url + "/healthz") as reply:
            assert reply.status == 503
            assert "Kafka source 'orders' cannot read (see coalescer status)" in (
                await reply.json())["reasons"]
    finally:
        await api.close()
    with down:
        await new_topic(down, name="orders")
        await produce(down, "orders", [{"orderId": "late"}])
        await wait_until(lambda: refreshed_keys(rec) == {"order:late"}, timeout=30)
        assert not c.health_problems()
        await until_equal(error, None)


async def test_a_broker_that_goes_away_stays_shown_as_down(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, nodes: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer.sources.kafka")
    broker = TansuBroker(kafka.binary, tmp_path).start()  # its own: this test stops it
    try:
        topic = await new_topic(broker)
        path, rec = setup(tmp_path, namespace, broker, topic)
        c = await nodes(path, redis_url, node_id="node-a")
        await produce(broker, topic, [{"orderId": "before"}])
        await wait_until(lambda: refreshed_keys(rec) == {"order:before"}, timeout=15)
    finally:
        broker.stop()  # memory storage: a restarted Tansu would have lost every topic
    await wait_until(lambda: sample(c, "coalescer_kafka_errors_total") >= 2, timeout=30,
                     message="two failed steps")
    assert c.health_problems() == ["Kafka source 'orders' cannot read (see coalescer status)"]
    assert "Kafka reachable again" not in caplog.text  # idle steps between do not say so
    assert (await c.query.status())["sources"]["orders"]["errors"]["node-a"]


# -- several nodes ------------------------------------------------------------------------

@pytest.mark.slow  # three group rebalances (Tansu delays the first join 5 s)
async def test_nodes_joining_and_leaving_share_partitions_and_lose_nothing(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str,
        nodes: Any) -> None:
    topic = await new_topic(kafka, partitions=4)
    path, rec = setup(tmp_path, namespace, kafka, topic, extra="    batch: 20\n")
    a = await nodes(path, redis_url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": f"a{n}"} for n in range(200)])
    await wait_until(lambda: len(refreshed_keys(rec)) == 200, timeout=15)
    b = await nodes(path, redis_url, node_id="node-b")  # the group rebalances: a gives up some

    async def readers() -> set[str]:
        found = (await b.query.status())["sources"]["orders"]["partitions"]
        return {entry["node"] for entry in found.values()}

    await produce(kafka, topic, [{"orderId": f"b{n}"} for n in range(200)])
    await until_equal(readers, {"node-a", "node-b"}, timeout=30,
                      message="both nodes reading partitions")
    await a.close()  # a leaves: its partitions go to b, committed before a gives them up
    await produce(kafka, topic, [{"orderId": f"c{n}"} for n in range(200)])
    await wait_until(lambda: len(refreshed_keys(rec)) == 600, timeout=30)
    await until_equal(lambda: total_committed(kafka, topic, 4), 600)


async def test_a_rebalance_commits_the_batch_in_hand_before_giving_up_partitions(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, *,
        own_server: ValkeyProcess, nodes: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="coalescer.sources.kafka")
    topic = await new_topic(kafka, partitions=2)
    path, _ = setup(tmp_path, namespace, kafka, topic)
    # two nodes on two Redis servers; a's stops answering before a reads its first batch
    # (the group's first join takes seconds), so that batch holds both partitions' messages
    a = await nodes(path, own_server.url, node_id="node-a")
    await produce(kafka, topic, [{"orderId": n} for n in range(50)])
    freeze(own_server)
    try:
        await wait_until(lambda: sample(a, "coalescer_kafka_unflushed_messages") == 50,
                         timeout=20, message="a batch of both partitions in a's hands")
        b = await nodes(path, redis_url, node_id="node-b")  # the group rebalances
        await wait_until(lambda: "the batch in hand is flushed and committed first"
                         in caplog.text, timeout=20, message="a's partitions revoked")
    finally:
        thaw(own_server)
    await produce(kafka, topic, [{"orderId": n} for n in range(50, 60)])
    await until_equal(lambda: total_committed(kafka, topic, 2), 60, timeout=30)

    def accepted() -> float:
        return sum(sample(node, "coalescer_source_entries_total", outcome="accepted")
                   for node in (a, b))

    # every message touched once: b read none of the batch a committed before giving up
    await until_equal(accepted, 60)
    assert sample(b, "coalescer_source_entries_total", outcome="accepted") > 0
    said = [r.getMessage() for r in caplog.records if r.name == "coalescer.sources.kafka"]
    taken = next(n for n, text in enumerate(said) if "flushed and committed first" in text)
    after = [text for text in said[taken:] if "committed 2 partition" in text
             or "gave up 2 partition" in text]
    assert after[:2] == ["source orders: committed 2 partition(s)",
                         "source orders: gave up 2 partition(s)"]  # a's batch, then the rest


# -- a node killed mid-batch ------------------------------------------------------------

@pytest.mark.slow
async def test_a_node_killed_mid_batch_loses_no_message(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str) -> None:
    topic = await new_topic(kafka, partitions=2)
    text = RULES.format(ns=namespace, bootstrap=kafka.bootstrap, topic=topic,
                        extra="    batch: 100\n").replace("{{mod}}", "{mod}")
    path = line_rules(tmp_path, f"lines_{namespace}", text)
    log = tmp_path / "lines.log"
    procs = NodeProcs(tmp_path)
    try:
        await produce(kafka, topic, [{"orderId": n} for n in range(20_000)])
        first = procs.start(path, redis_url, "node-a", E2E_LOG=str(log))

        async def some_committed() -> bool:
            return 0 < await total_committed(kafka, topic, 2) < 20_000

        await wait_until(some_committed, timeout=30, message="a batch committed")
        first.kill()  # SIGKILL mid-stream: what it read and did not commit is read again
        first.wait()
        procs.start(path, redis_url, "node-b", E2E_LOG=str(log))
        await until_equal(lambda: total_committed(kafka, topic, 2), 20_000, timeout=60)
        await wait_until(lambda: {key for phase, _, key, _, _ in read_lines(log)
                                  if phase == "done"} == {f"order:{n}" for n in range(20_000)},
                         timeout=60, message="every key refreshed")
    finally:
        procs.stop_all()


# -- a time per message -----------------------------------------------------------------

async def test_messages_schedule_their_keys_by_their_own_delay(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, nodes: Any, *,
        redis_client: Any) -> None:
    topic = await new_topic(kafka)
    path, _ = setup(tmp_path, namespace, kafka, topic, extra='    delay: "{delayTime}m"\n')
    c = await nodes(path, redis_url)
    before = await server_ms(redis_client)
    await produce(kafka, topic, [{"orderId": "late", "delayTime": 30},
                                 {"orderId": "soon", "delayTime": "soon"},
                                 {"orderId": "none"}, {"orderId": "neg", "delayTime": -5}])
    await until_equal(lambda: committed(kafka, topic), [4])
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == 3)
    after = await server_ms(redis_client)
    late = await due(redis_client, namespace, "order:late")
    assert late is not None and late.scheduled
    assert before + 1_800_000 <= late.due_ms <= after + 1_800_000
    for key in ("soon", "none", "neg"):
        assert await due(redis_client, namespace, f"order:{key}") is None
