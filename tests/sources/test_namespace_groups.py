"""A namespace isolates its sources: a stream or Kafka source with no ``group:`` reads in a
consumer group named after the namespace (``coalescer.NAMESPACE.SOURCE``).

One rules file, loaded under two ``$COALESCER_NAMESPACE`` values as two deployments
would: each deployment reads every message; a drain in one namespace (a test's) never
reads with, nor commits for, another's group. Real coalescer nodes on the suite's
valkey-server and a real Kafka-protocol broker (Tansu, the suite's ``kafka`` fixture).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.config.namespace_env import ENV_NAMESPACE
from coalescer.config.rules import Config
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import new_topic, produce

KAFKA_RULES = """\
namespace: shop
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
    start: earliest
    key: "order:{{orderId}}"
"""

STREAM_RULES = """\
namespace: shop
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
    stream: "{stream}"
    key: "order:{{orderId}}"
"""


@pytest_asyncio.fixture
async def deploy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """deploy(rules_path, namespace, **options) -> a started Coalescer of the rules file
    with ``$COALESCER_NAMESPACE`` set to ``namespace`` (as a deployment's environment
    would), closed at teardown."""
    async with AsyncExitStack() as stack:
        async def make(path: Path, namespace: str, **options: Any) -> Coalescer:
            monkeypatch.setenv(ENV_NAMESPACE, namespace)
            options.setdefault("grace", 2.0)
            worker = options.get("worker", True)
            c = Coalescer(Config.from_yaml(path, import_handlers=worker), **options)
            await stack.enter_async_context(c)
            return c

        yield make


def accepted(c: Coalescer) -> float:
    """How many messages this node turned into touches."""
    value = c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": "orders", "outcome": "accepted"})
    return value or 0.0


async def group_offsets(broker: TansuBroker, topic: str, group: str,
                        partitions: int = 1) -> list[int | None]:
    """The committed offset of each partition of ``topic`` in ``group``, from the broker."""
    consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        return [await consumer.committed(TopicPartition(topic, p)) for p in range(partitions)]
    finally:
        await consumer.stop()


def test_check_shows_the_group_derived_from_the_namespace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("""\
rules:
  - {name: order, match: "order:{id}", handler: builtins:repr}
sources:
  - {name: orders, stream: "app:orders", key: "order:{orderId}"}
  - {name: audit, stream: "app:orders", group: shared, key: "order:{orderId}"}
""")
    monkeypatch.setenv(ENV_NAMESPACE, "staging")
    assert main(["check", "--json", str(path)]) == 0
    sources = json.loads(capsys.readouterr().out)["sources"]
    assert [(s["name"], s["group"]) for s in sources] == [
        ("orders", "coalescer.staging.orders"), ("audit", "shared")]
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(group coalescer.staging.orders, start new)" in out
    assert "(group shared, start new)" in out


async def test_two_namespaces_of_one_rules_file_each_read_every_stream_entry(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        deploy: Any) -> None:
    stream = f"{namespace}-app:orders"
    path, rec = recorder_rules(tmp_path, f"ns_stream_{namespace}",
                               STREAM_RULES.format(stream=stream))
    blue = await deploy(path, f"{namespace}-blue", redis_url=redis_url)
    green = await deploy(path, f"{namespace}-green", redis_url=redis_url)
    groups = {f"coalescer.{namespace}-blue.orders", f"coalescer.{namespace}-green.orders"}
    await wait_until(lambda: _groups(redis_client, stream, groups), message="both groups")
    for n in range(100):
        await redis_client.xadd(stream, {"orderId": str(n)})

    await wait_until(lambda: accepted(blue) == accepted(green) == 100, timeout=20,
                     message="each namespace read every entry")
    await wait_until(lambda: len(rec.calls) == 200, timeout=20,
                     message="each order refreshed once in each namespace")
    status = await blue.query.status()
    assert status["sources"]["orders"]["group"] == f"coalescer.{namespace}-blue.orders"


def test_status_json_shows_the_group_derived_from_the_namespace(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("""\
rules:
  - {name: order, match: "order:{id}", handler: builtins:repr}
sources:
  - {name: orders, stream: "app:orders", key: "order:{orderId}"}
""")
    monkeypatch.setenv(ENV_NAMESPACE, "staging")
    assert main(["status", "--json", "--rules", str(path), "--redis", redis_url]) == 0
    shown = json.loads(capsys.readouterr().out)["sources"]["orders"]
    assert shown["group"] == "coalescer.staging.orders"
    assert main(["status", "--rules", str(path), "--redis", redis_url]) == 0
    assert "app:orders (coalescer.staging.orders)" in capsys.readouterr().out


async def _groups(redis: Any, stream: str, names: set[str]) -> bool:
    if not await redis.exists(stream):
        return False
    return names <= {g["name"] for g in await redis.xinfo_groups(stream)}


@pytest.mark.slow  # two groups join (Tansu delays a group's first join by seconds)
async def test_two_namespaces_of_one_rules_file_each_read_every_kafka_message(
        tmp_path: Path, namespace: str, redis_url: str, kafka: TansuBroker,
        deploy: Any) -> None:
    topic = await new_topic(kafka, partitions=2)
    path, rec = recorder_rules(tmp_path, f"ns_kafka_{namespace}", KAFKA_RULES.format(
        bootstrap=kafka.bootstrap, topic=topic))
    blue = await deploy(path, f"{namespace}-blue", redis_url=redis_url)
    green = await deploy(path, f"{namespace}-green", redis_url=redis_url)
    await produce(kafka, topic, [{"orderId": n} for n in range(150)], partition=0)
    await produce(kafka, topic, [{"orderId": n} for n in range(150, 300)], partition=1)

    await wait_until(lambda: accepted(blue) == accepted(green) == 300, timeout=60,
                     message="each namespace read every message")
    await wait_until(lambda: len(rec.calls) == 600, timeout=30,
                     message="each order refreshed once in each namespace")
    for ns in (f"{namespace}-blue", f"{namespace}-green"):
        assert await group_offsets(kafka, topic, f"coalescer.{ns}.orders", 2) == [150, 150]
    status = await green.query.status()
    assert status["sources"]["orders"]["group"] == f"coalescer.{namespace}-green.orders"


@pytest.mark.slow  # a group joins (Tansu delays a group's first join by seconds)
async def test_a_drain_in_another_namespace_leaves_a_deployment_its_messages(
        tmp_path: Path, namespace: str, redis_url: str, kafka: TansuBroker,
        deploy: Any) -> None:
    topic = await new_topic(kafka)
    path, rec = recorder_rules(tmp_path, f"ns_drain_{namespace}", KAFKA_RULES.format(
        bootstrap=kafka.bootstrap, topic=topic))
    dev_group = f"coalescer.{namespace}-dev.orders"
    dev = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await produce(kafka, topic, [{"orderId": n} for n in range(5)])
    await wait_until(lambda: accepted(dev) == 5, timeout=30, message="dev read its first 5")
    await wait_until(lambda: _offsets_are(kafka, topic, dev_group, [5]), timeout=15)
    await dev.close()  # the deployment is down; messages published meanwhile wait for it
    await produce(kafka, topic, [{"orderId": n} for n in range(5, 50)])

    test = await deploy(path, f"{namespace}-test", redis_url=redis_url, worker=False)
    claims = await test.drain(timeout=30)

    # the test's drain read the topic with its own group (start: earliest, every message)
    assert len(claims) == 50
    assert await group_offsets(kafka, topic, dev_group) == [5]  # dev's, untouched
    assert await group_offsets(kafka, topic, f"coalescer.{namespace}-test.orders") == [50]
    dev_again = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await wait_until(lambda: accepted(dev_again) == 45, timeout=30,
                     message="the deployment handled every message it had not read")
    await wait_until(lambda: _offsets_are(kafka, topic, dev_group, [50]), timeout=15)
    assert rec.calls  # the handlers ran in both namespaces


async def _offsets_are(broker: TansuBroker, topic: str, group: str,
                       expected: list[int]) -> bool:
    return await group_offsets(broker, topic, group, len(expected)) == expected


async def test_a_stream_whose_old_default_group_holds_entries_is_warned_of(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, deploy: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    stream = f"{namespace}-app:orders"
    await redis_client.xgroup_create(stream, "coalescer", id="$", mkstream=True)
    for n in range(3):
        await redis_client.xadd(stream, {"orderId": str(n)})
    await redis_client.xreadgroup("coalescer", "old-node", {stream: ">"}, count=1)
    path, _ = recorder_rules(tmp_path, f"ns_old_{namespace}", STREAM_RULES.format(
        stream=stream))
    with caplog.at_level(logging.WARNING, logger="coalescer.sources.streams"):
        await deploy(path, namespace, redis_url=redis_url)
        await wait_until(lambda: _groups(redis_client, stream,
                                         {f"coalescer.{namespace}.orders"}))
        await wait_until(lambda: "still holds" in caplog.text, timeout=5)
    assert (f"source orders: the group 'coalescer' of stream '{stream}' (the default group "
            "before namespaces named groups) still holds 1 pending and 2 unread entries, "
            f"which this source's group 'coalescer.{namespace}.orders' does not read; to "
            "read them, set group: coalescer in the source") in caplog.text


@pytest.mark.slow  # some 7-10 s: with the long scenarios, out of the quick run
async def test_a_stream_drain_in_another_namespace_leaves_a_deployment_its_entries(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        deploy: Any) -> None:
    stream = f"{namespace}-app:orders"
    path, rec = recorder_rules(tmp_path, f"ns_sdrain_{namespace}", STREAM_RULES.format(
        stream=stream).replace("    stream:", "    start: all\n    stream:"))
    dev_group = f"coalescer.{namespace}-dev.orders"
    dev = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await wait_until(lambda: _groups(redis_client, stream, {dev_group}))
    await dev.close()  # the deployment is down; entries written meanwhile wait for it
    for n in range(20):
        await redis_client.xadd(stream, {"orderId": str(n)})

    test = await deploy(path, f"{namespace}-test", redis_url=redis_url, worker=False)
    assert len(await test.drain(timeout=30)) == 20  # start: all, in the test's own group

    (dev_info,) = [g for g in await redis_client.xinfo_groups(stream)
                   if g["name"] == dev_group]
    assert (dev_info["lag"], dev_info["pending"]) == (20, 0)  # dev's, untouched
    dev_again = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await wait_until(lambda: accepted(dev_again) == 20, timeout=20,
                     message="the deployment handled every entry it had not read")
    await wait_until(lambda: len(rec.calls) == 40, timeout=20,
                     message="each order refreshed once in each namespace")


async def test_a_stream_drain_never_reads_in_the_group_the_rules_name(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        deploy: Any) -> None:
    stream = f"{namespace}-app:shared"
    path, _ = recorder_rules(tmp_path, f"ns_named_{namespace}", STREAM_RULES.format(
        stream=stream).replace("    stream:", "    start: all\n    group: shared\n    stream:"))
    dev = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await wait_until(lambda: _groups(redis_client, stream, {"shared"}))
    await dev.close()
    for n in range(10):
        await redis_client.xadd(stream, {"orderId": str(n)})

    test = await deploy(path, f"{namespace}-test", redis_url=redis_url, worker=False)
    assert len(await test.drain(timeout=30)) == 10  # in coalescer.NS-test.orders

    groups = {g["name"]: g for g in await redis_client.xinfo_groups(stream)}
    assert set(groups) == {"shared", f"coalescer.{namespace}-test.orders"}
    assert (groups["shared"]["lag"], groups["shared"]["pending"]) == (10, 0)  # untouched
    dev_again = await deploy(path, f"{namespace}-dev", redis_url=redis_url)
    await wait_until(lambda: accepted(dev_again) == 10, timeout=20,
                     message="the deployment still read every entry in its group")
