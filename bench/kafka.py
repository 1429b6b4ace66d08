"""The Kafka source on a real Kafka-protocol broker (Tansu, bench.kafka_broker).

``kafka_throughput``: N messages with JSON values (``{"userId": ..., "eventId": ...}``,
distinct keys) already in a topic of 4 partitions; a node starts, and messages/s is the
messages touched (in Redis) from its first batch to the last, over that time (the
start-up, mostly Tansu's first group join, is reported apart as ``start_s``). Beside
it, the baseline design: the seed's consumer, which parks each message in a Redis sorted
set (``ZADD`` of its due time, one pipeline a batch) and commits, timed the same way.

``kafka_burst``: a burst of ``sizes.million`` messages waits in the topic; a ``coalescer
run`` node reads them all (batch 5,000), and the figure is its peak RSS (VmHWM) once
every message is committed. Beside it, the seed's in-process delay queue (every
message parked in a heap in memory until its time), whose peak RSS grows with the burst.

Tansu keeps messages in memory only, and delays a group's first join by about 5 s.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from coalescer import Coalescer, Config

from . import common as C
from .kafka_broker import TansuBroker, find_tansu
from .valkey import Server

PARTITIONS = 4
TOPIC = "events"
BURST_BATCH = 5000


def rules_text(bootstrap: str, batch: int = BURST_BATCH) -> str:
    text = C.rules_text(window="1h", max_wait="1h", handler="builtins:repr")
    return text + textwrap.dedent(f"""\
        sources:
          - name: events
            type: kafka
            bootstrap: "{bootstrap}"
            topics: [{TOPIC}]
            group: bench
            start: earliest
            batch: {batch}
            key: "stats:user:{{userId}}"
        """)


async def fill_topic(broker: TansuBroker, n: int) -> None:
    """Create the topic and publish ``n`` JSON messages, distinct keys, in batches."""
    from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]

    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, num_partitions=PARTITIONS,
                                            replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=20,
                                max_batch_size=1 << 20)
    await producer.start()
    try:
        for start in range(0, n, 10_000):
            sent = [await producer.send(TOPIC, json.dumps(
                {"userId": i, "eventId": f"e{i}", "delayTime": 30}).encode(),
                partition=i % PARTITIONS) for i in range(start, min(n, start + 10_000))]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()


def _broker(tmp: Path) -> TansuBroker:
    binary, why = find_tansu()
    if binary is None:
        raise RuntimeError(f"no Kafka broker: {why}")
    return TansuBroker(binary, tmp).start()


def _accepted(c: Coalescer) -> int:
    value = c.metrics.registry.get_sample_value("coalescer_source_entries_total",
                                                {"source": "events", "outcome": "accepted"})
    return int(value or 0)


async def kafka_throughput(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    n = 200_000 if sizes.drain_keys >= 50_000 else 50_000
    broker = _broker(tmp)
    try:
        await fill_topic(broker, n)
        t0 = time.perf_counter()
        config = Config.from_string(rules_text(broker.bootstrap), source="<bench>")
        async with Coalescer(config, redis_url=server.url, node_id="bench") as c:
            deadline = time.monotonic() + 120
            while _accepted(c) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            t1, first = time.perf_counter(), _accepted(c)
            while _accepted(c) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            t2, done = time.perf_counter(), _accepted(c)
    finally:
        broker.stop()
    return {"messages": n, "touched": done, "start_s": t1 - t0, "seconds": t2 - t1,
            "per_second": (done - first) / (t2 - t1)}


async def kafka_baseline(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    """The seed's consumer: ZADD each message's due time (a pipeline a batch), commit."""
    import redis.asyncio
    from aiokafka import AIOKafkaConsumer

    n = 200_000 if sizes.drain_keys >= 50_000 else 50_000
    broker = _broker(tmp)
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        await fill_topic(broker, n)
        consumer = AIOKafkaConsumer(TOPIC, bootstrap_servers=broker.bootstrap,
                                    group_id="baseline", enable_auto_commit=False,
                                    auto_offset_reset="earliest")
        await consumer.start()
        done, first, t0 = 0, 0, time.perf_counter()
        try:
            while done < n and time.perf_counter() - t0 < 120:
                batch = await consumer.getmany(timeout_ms=1000, max_records=BURST_BATCH)
                pipe = client.pipeline(transaction=False)
                now = time.time()
                for messages in batch.values():
                    for m in messages:
                        value = json.loads(m.value)
                        pipe.zadd("delay:orders", {str(value["userId"]):
                                                   now + 60 * value["delayTime"]})
                        done += 1
                await pipe.execute()
                await consumer.commit()
                if not first:  # timed from the first batch, as the node is
                    first, t0 = done, time.perf_counter()
        finally:
            await consumer.stop()
        seconds = time.perf_counter() - t0
    finally:
        await client.aclose()
        broker.stop()
    return {"messages": n, "touched": done, "seconds": seconds,
            "per_second": (done - first) / seconds}


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def _committed(broker: TansuBroker, group: str) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        offsets = [await consumer.committed(TopicPartition(TOPIC, p))
                   for p in range(PARTITIONS)]
    finally:
        await consumer.stop()
    return sum(offset or 0 for offset in offsets)


async def kafka_burst(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    """A `coalescer run` node reads a burst of ``sizes.million`` messages: its peak RSS."""
    n = sizes.million
    broker = _broker(tmp)
    rules = tmp / f"kafka-burst-{time.monotonic_ns()}.yaml"
    rules.write_text(rules_text(broker.bootstrap))
    node = None
    try:
        await fill_topic(broker, n)
        t0 = time.perf_counter()
        node = subprocess.Popen([sys.executable, "-m", "coalescer.cli", "run", "--rules",
                                 str(rules), "--redis", server.url, "--http", "off"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while await _committed(broker, "bench") < n and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        seconds = time.perf_counter() - t0
        committed = await _committed(broker, "bench")
        peak = _peak_rss_mb(node.pid)
    finally:
        if node is not None:
            node.terminate()
            node.wait(30)
        broker.stop()
    return {"messages": n, "committed": committed, "seconds": seconds, "peak_rss_mb": peak}


async def kafka_burst_baseline(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    """The seed's in-process delay queue: every message parked in a heap until its time."""
    n = sizes.million
    broker = _broker(tmp)
    try:
        await fill_topic(broker, n)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.kafka_queue", broker.bootstrap, TOPIC, str(n),
            stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(child.communicate(), 600)
        found: dict[str, Any] = json.loads(out)
    finally:
        broker.stop()
    return {"messages": n, **found}
