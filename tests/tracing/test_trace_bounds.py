"""What tracing keeps is bounded and leaves with its key: trace contexts are stored in
Redis only for keys Redis accepted, deleted when the key is cancelled, purged, trimmed
by the dead-letter limits or done, expire soon after the key's due time; a node holds
no trace state for touches it refused (a real valkey-server, the real OpenTelemetry SDK
with its in-memory exporter, a real Kafka-protocol broker)."""

from __future__ import annotations

import functools
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.errors import QuotaExceededError
from coalescer.tracing.bounds import GRACE_MS, MAX_BYTES_PER_KEY
from coalescer.tracing.touches import TouchTraces
from tests.conftest import RulesFactory, Start
from tests.helpers.servers import wait_until
from tests.sources.test_kafka import committed, new_topic, nodes, sample, setup  # noqa: F401
from tests.tracing.test_refresh_spans import exporter, refresh_spans  # noqa: F401

RULES = """\
namespace: {ns}
shards: 1
claim_lease: 2s
limits: {{pending_keys: {pending}, dead_letters: {dead}, dead_letter_ttl: 1h}}
defaults: {{window: {window}, max_wait: 1h, absorb: 5ms, timeout: 2s,
           retry: {{attempts: 1, backoff: 10ms, max_backoff: 10ms}}}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: handlers:refresh
  - name: bad
    match: "bad:{{id}}"
    handler: handlers:fail
"""

HANDLERS = """\
import asyncio

hold = set()  # keys whose refresh waits for ``go``
running = []
go = asyncio.Event()


async def refresh(claim):
    running.append(claim.key)
    if claim.key in hold:
        await go.wait()


async def fail(claim):
    raise RuntimeError("broken on purpose")
"""


def rules(namespace: str, *, window: str = "1h", pending: int = 1000,
          dead: int = 1000) -> str:
    return textwrap.dedent(RULES.format(ns=namespace, window=window, pending=pending,
                                        dead=dead))


async def traces_in_redis(c: Coalescer) -> list[str]:
    """Every trace-contexts key of the namespace in Redis (SCAN over its prefix)."""
    found: list[str] = []
    for shard in c.keyspace.all_shards():
        async for name in c.redis.scan_iter(match=shard.traces_prefix + "*", count=1000):
            found.append(name.decode() if isinstance(name, bytes) else str(name))
    return sorted(found)


def touch_in_span(c: Coalescer, *keys: str) -> None:
    with trace.get_tracer("app").start_as_current_span("request"):
        c.touch_many(list(keys))


def node_traces(c: Coalescer) -> TouchTraces:
    traces = c._traces
    assert traces is not None, "tracing is on"
    return traces


async def _state(c: Coalescer, key: str, state: str) -> bool:
    return bool((await c.query.explain(key))["state"] == state)


def test_a_nodes_trace_buffer_is_bounded_and_forgets_what_no_write_took(
        exporter: InMemorySpanExporter) -> None:  # noqa: F811
    traces = TouchTraces(8, max_keys=5, stale=60.0)
    with trace.get_tracer("app").start_as_current_span("request"):
        for n in range(10):
            traces.record(f"item:{n}")
    assert (len(traces), traces.refused) == (5, 5)  # the first five keys' contexts
    traces.forget(["item:0"])
    assert traces.sweep() == 0 and len(traces) == 4  # none waited a minute yet
    assert traces.sweep(now=time.monotonic() + 61) == 4  # no write took them: dropped
    assert len(traces) == 0
    with trace.get_tracer("app").start_as_current_span("request"):
        traces.record("item:new")
    assert list(traces.take(["item:new"])) == ["item:new"]


async def test_a_cancelled_key_leaves_no_trace_context(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), HANDLERS), redis_url=redis_url, worker=False)
    touch_in_span(c, "item:1", "item:2")
    await c.flush()
    shard = c.keyspace.shard(0)
    assert await traces_in_redis(c) == [shard.traces("item:1"), shard.traces("item:2")]
    await c.cancel_many(["item:1"])
    assert await traces_in_redis(c) == [shard.traces("item:2")]
    assert len(node_traces(c)) == 0


async def test_contexts_expire_soon_after_their_keys_due_time_not_a_day_later(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), HANDLERS), redis_url=redis_url, worker=False)
    touch_in_span(c, "item:1")
    await c.flush()
    ttl_ms = await c.redis.pttl(c.keyspace.shard(0).traces("item:1"))
    hour = 3600 * 1000
    assert hour < ttl_ms <= hour + GRACE_MS  # its window, then the grace


async def test_a_keys_contexts_in_redis_stay_within_their_bound_however_many_touches(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), HANDLERS), redis_url=redis_url, worker=False)
    for _ in range(20):
        for _ in range(10):
            touch_in_span(c, "item:1")
        await c.flush()
    value = await c.redis.get(c.keyspace.shard(0).traces("item:1"))
    assert value is not None
    dropped, first, last, _ = (value.decode() if isinstance(value, bytes) else value).split("|")
    assert (int(dropped), len(first.split(",")), len(last.split(","))) == (184, 8, 8)
    assert len(value) <= MAX_BYTES_PER_KEY


async def test_a_touch_the_upsert_drops_leaves_no_trace_context(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace), HANDLERS), redis_url=redis_url, worker=False)
    shard = c.keyspace.shard(0)
    await c.redis.hset(shard.meta, "item:broken", "P|not|a|state")  # a state it cannot read
    touch_in_span(c, "item:broken", "item:fine")
    await c.flush()
    assert [d.key for d in c._run.flusher.dropped] == ["item:broken"]
    assert await traces_in_redis(c) == [shard.traces("item:fine")]
    assert len(node_traces(c)) == 0


async def test_touches_refused_by_the_pending_keys_limit_leave_no_trace_context(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    path = rules_file(rules(namespace, pending=3), HANDLERS)
    c = await start(path, redis_url=redis_url, worker=False)
    touch_in_span(c, "item:1", "item:2", "item:3")
    await c.flush()
    await wait_until(lambda: c._run.quota is not None and c._run.quota.pending == 3,
                     message="a count of the 3 pending keys")
    for n in range(4, 40):
        with pytest.raises(QuotaExceededError):
            touch_in_span(c, f"item:{n}")
    await c.flush()
    assert len(await traces_in_redis(c)) == 3  # the accepted keys' only
    assert len(node_traces(c)) == 0


async def test_dead_letters_purged_leave_no_trace_context(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace, window="20ms"), HANDLERS),
                    redis_url=redis_url)
    touch_in_span(c, "bad:1", "bad:2")
    for key in ("bad:1", "bad:2"):
        await wait_until(functools.partial(_state, c, key, "dead"), message=f"{key} dead")
    shard = c.keyspace.shard(0)

    async def tried_kept() -> bool:  # the failed try's context, for a retry to link to
        return await traces_in_redis(c) == [shard.traces("bad:1"), shard.traces("bad:2")]

    await wait_until(tried_kept, message="the failed tries' contexts kept")
    await c.query.purge_dead(["bad:1"])
    assert await traces_in_redis(c) == [shard.traces("bad:2")]
    await c.query.purge_dead()
    assert await traces_in_redis(c) == []


async def test_dead_letters_the_limits_drop_leave_no_trace_context(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace, window="20ms", dead=1), HANDLERS),
                    redis_url=redis_url)
    shard = c.keyspace.shard(0)
    for key in ("bad:1", "bad:2", "bad:3"):
        touch_in_span(c, key)
        await wait_until(functools.partial(_state, c, key, "dead"), message=f"{key} dead")

    await wait_until(lambda: c.metrics.dead_letters_dropped.labels("count")._value.get() == 2,
                     message="the 2 oldest dead letters dropped")

    async def newest_only() -> bool:  # bad:3's failed try's context: its write may lag
        return await traces_in_redis(c) == [shard.traces("bad:3")]

    await wait_until(newest_only, message="only the dead letter kept has contexts")


async def test_after_their_refreshes_no_context_is_left_for_the_keys(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace, window="30ms"), HANDLERS),
                    redis_url=redis_url)
    keys = [f"item:{n}" for n in range(50)]
    for _ in range(3):  # bursts, the later touches landing while earlier runs go on
        touch_in_span(c, *keys)
        await c.flush()
    await refresh_spans(exporter, len(keys))

    async def all_done() -> bool:
        return all([await _state(c, key, "idle") for key in keys])

    await wait_until(all_done, message="every key refreshed and done")
    assert await traces_in_redis(c) == []
    assert len(node_traces(c)) == 0


async def test_a_refresh_that_finishes_its_key_deletes_contexts_written_while_it_ran(
        exporter: InMemorySpanExporter, rules_file: RulesFactory, start: Start,  # noqa: F811
        redis_url: str, namespace: str) -> None:
    c = await start(rules_file(rules(namespace, window="10ms"), HANDLERS),
                    redis_url=redis_url)
    handlers = sys.modules["handlers"]
    handlers.hold.add("item:1")
    touch_in_span(c, "item:1")
    await wait_until(lambda: "item:1" in handlers.running, message="item:1 running")
    shard = c.keyspace.shard(0)
    late = "0|00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01||"
    # a write of contexts that reached Redis after the claim had taken the others
    await c._run.scripts.traces_put(shard, {"item:1": late}, 8, GRACE_MS)
    assert await traces_in_redis(c) == [shard.traces("item:1")]
    handlers.go.set()
    await wait_until(functools.partial(_state, c, "item:1", "idle"), message="item:1 done")
    assert await traces_in_redis(c) == []


async def test_a_node_keeps_no_trace_state_for_kafka_messages_it_rejects(
        *, exporter: InMemorySpanExporter, kafka: TansuBroker, namespace: str,  # noqa: F811
        redis_url: str, tmp_path: Path, nodes: Any) -> None:  # noqa: F811
    topic = await new_topic(kafka)
    path, _ = setup(tmp_path, namespace, kafka, topic)
    path.write_text(path.read_text().replace('key: "order:{orderId}"',
                                             'key: "{kind}:{orderId}"'))
    c = await nodes(path, redis_url, node_id="node-a")
    with trace.get_tracer("app").start_as_current_span("publish") as span:
        ctx = span.get_span_context()
    header = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01".encode()
    refused = [{"kind": "user", "orderId": f"u{n}"} for n in range(200)]  # no rule takes
    refused += [{"kind": "order", "orderId": "x" * 2000 + str(n)} for n in range(20)]  # too long
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()
    try:
        for value in [*refused, {"kind": "order", "orderId": "ok"}]:
            await producer.send(topic, json.dumps(value).encode(),
                                headers=[("traceparent", header)])
        await producer.flush()
    finally:
        await producer.stop()
    await wait_until(lambda: sample(c, "coalescer_source_entries_total",
                                    outcome="rejected") == len(refused), timeout=15)
    [refresh] = await refresh_spans(exporter, 1)
    assert dict(refresh.attributes or {})["coalescer.key"] == "order:ok"
    assert len(node_traces(c)) == 0
