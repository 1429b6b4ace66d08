"""Tracing with the real OpenTelemetry SDK: a writer's touches record their spans'
contexts, and the refresh they caused on a node is a CONSUMER span of a trace of its
own that links to them (read back from the SDK's in-memory exporter)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from coalescer import Coalescer
from coalescer.config.rules import Config
from tests.helpers.servers import wait_until

HANDLERS = """\
from opentelemetry import trace

fail_once = set()  # keys whose first try raises
calls = []


async def refresh(claim):
    calls.append(claim)
    with trace.get_tracer("handlers").start_as_current_span("recompute " + claim.key):
        if claim.key in fail_once and claim.attempt == 1:
            raise RuntimeError("planned failure")


async def refresh_batch(claims):
    calls.append(list(claims))
    return [c for c in claims if c.key in fail_once and c.attempt == 1]
"""

RULES = """\
namespace: {ns}
defaults:
  absorb: 1ms
  window: 100ms
  retry: {{attempts: 3, backoff: 50ms, max_backoff: 50ms}}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: handlers:refresh
  - name: bunch
    match: "bunch:{{id}}"
    handler: handlers:refresh_batch
    batch: {{max: 10, wait: 200ms}}
"""

Pair = tuple[Coalescer, Coalescer, Any]  # a writer, a node, the handlers module


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """A real SDK tracer provider as the process's global one, for this test only."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield spans
    provider.shutdown()


@pytest_asyncio.fixture
async def pair(namespace: str, redis_url: str,
               rules_file: Any) -> AsyncIterator[Callable[[], Awaitable[Pair]]]:
    async with AsyncExitStack() as stack:
        async def make() -> Pair:
            config = Config.from_yaml(rules_file(RULES.format(ns=namespace), HANDLERS))
            writer = Coalescer(config, redis_url=redis_url, worker=False)
            node = Coalescer(config, redis_url=redis_url, worker=True, grace=1.0)
            await stack.enter_async_context(writer)
            await stack.enter_async_context(node)
            return writer, node, sys.modules["handlers"]

        yield make


def touch_in_span(writer: Coalescer, key: str, name: str) -> SpanContext:
    """Touch ``key`` inside a span of the writer's own; that span's context."""
    with trace.get_tracer("app").start_as_current_span(name) as span:
        writer.touch(key)
        return span.get_span_context()


async def refresh_spans(spans: InMemorySpanExporter, n: int) -> list[ReadableSpan]:
    """The first ``n`` refresh spans to end (CONSUMER spans named "process ...")."""
    def found() -> list[ReadableSpan] | None:
        done = [s for s in spans.get_finished_spans()
                if s.kind == SpanKind.CONSUMER and s.name.startswith("process ")]
        return done if len(done) >= n else None
    got: list[ReadableSpan] = await wait_until(found, timeout=10, message=f"{n} refresh spans")
    return got


def linked(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def ids(ctx: SpanContext | None) -> tuple[int, int]:
    assert ctx is not None
    return ctx.trace_id, ctx.span_id


async def test_a_refresh_starts_a_trace_that_links_to_the_touches_of_its_burst(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()
    first = touch_in_span(writer, "stats:1", "request 1")
    await writer.flush()
    second = touch_in_span(writer, "stats:1", "request 2")
    await writer.flush()
    [refresh] = await refresh_spans(exporter, 1)
    assert refresh.name == "process stats"
    assert refresh.parent is None
    assert refresh.context.trace_id not in {first.trace_id, second.trace_id}
    assert linked(refresh) == [ids(first), ids(second)]
    attributes = dict(refresh.attributes or {})
    assert attributes["messaging.batch.message_count"] == 2
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.system"] == "coalescer"
    assert attributes["messaging.destination.name"] == "stats"
    assert attributes["coalescer.key"] == "stats:1"
    [work] = [s for s in exporter.get_finished_spans() if s.name == "recompute stats:1"]
    assert work.parent is not None and work.parent.span_id == refresh.context.span_id
    shard = writer.keyspace.shard(0)
    assert not await writer.redis.exists(shard.traces("stats:1"))  # taken by the refresh


async def test_touch_many_and_the_waiting_touches_record_the_callers_span(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()
    tracer = trace.get_tracer("app")
    with tracer.start_as_current_span("many") as many:
        writer.touch_many(["stats:m1"])
    with tracer.start_as_current_span("waiting") as waiting:
        await writer.touch_many_wait(["stats:m2"])
    await writer.flush()
    spans = await refresh_spans(exporter, 2)
    links = {dict(s.attributes or {})["coalescer.key"]: linked(s) for s in spans}
    assert links == {"stats:m1": [ids(many.get_span_context())],
                     "stats:m2": [ids(waiting.get_span_context())]}


async def test_a_touch_that_blocks_a_thread_for_room_records_that_threads_span(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()

    def blocking() -> SpanContext:  # as SyncCoalescer's touch_wait does, from a thread
        with trace.get_tracer("app").start_as_current_span("blocking") as span:
            writer.touch_blocking(["stats:b1"])
            return span.get_span_context()

    caller = await asyncio.to_thread(blocking)
    await writer.flush()
    [refresh] = await refresh_spans(exporter, 1)
    assert linked(refresh) == [ids(caller)]


async def test_a_long_burst_keeps_its_first_and_last_eight_touches_and_counts_them_all(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()
    touches = []
    for i in range(20):
        touches.append(touch_in_span(writer, "stats:2", f"request {i}"))
        if i in (9, 19):  # two writes: Redis merges what the second brings
            await writer.flush()
    [refresh] = await refresh_spans(exporter, 1)
    assert linked(refresh) == [ids(t) for t in touches[:8] + touches[12:]]
    assert dict(refresh.attributes or {})["messaging.batch.message_count"] == 20
    assert dict(refresh.attributes or {})["coalescer.links_dropped"] == 4


async def test_a_retry_links_to_the_failed_try(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, handlers = await pair()
    handlers.fail_once.add("stats:3")
    touched = touch_in_span(writer, "stats:3", "request")
    await writer.flush()
    failed, retry = await refresh_spans(exporter, 2)
    assert failed.status.status_code == StatusCode.ERROR
    assert linked(failed) == [ids(touched)]
    assert retry.status.status_code != StatusCode.ERROR
    assert linked(retry) == [ids(failed.context)]
    assert dict(retry.links[0].attributes or {}) == {"coalescer.link": "retry"}
    assert dict(retry.attributes or {})["coalescer.attempt"] == 2


async def test_a_batch_call_is_one_span_with_a_child_per_key(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()
    a = touch_in_span(writer, "bunch:a", "request a")
    b = touch_in_span(writer, "bunch:b", "request b")
    await writer.flush()
    [call] = await refresh_spans(exporter, 1)
    assert call.name == "process bunch" and call.parent is None
    assert dict(call.attributes or {})["messaging.batch.message_count"] == 2
    children = {dict(s.attributes or {})["coalescer.key"]: s
                for s in exporter.get_finished_spans()
                if s.parent is not None and s.parent.span_id == call.context.span_id}
    assert set(children) == {"bunch:a", "bunch:b"}
    assert linked(children["bunch:a"]) == [ids(a)]
    assert linked(children["bunch:b"]) == [ids(b)]


async def test_a_key_a_batch_call_failed_links_its_retry_to_its_span_in_that_call(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, handlers = await pair()
    handlers.fail_once.add("bunch:bad")
    touch_in_span(writer, "bunch:ok", "request ok")
    touch_in_span(writer, "bunch:bad", "request bad")
    await writer.flush()
    await refresh_spans(exporter, 2)  # the call, and the retry's call

    def keyed(key: str) -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans()
                if dict(s.attributes or {}).get("coalescer.key") == key]
    [ok] = keyed("bunch:ok")
    failed, retry = keyed("bunch:bad")
    assert ok.status.status_code != StatusCode.ERROR
    assert failed.status.status_code == StatusCode.ERROR
    assert linked(retry) == [ids(failed.context)]
    assert dict(retry.attributes or {})["coalescer.attempt"] == 2


async def test_a_traces_key_redis_cannot_read_costs_the_links_not_the_refresh(
        exporter: InMemorySpanExporter, pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, handlers = await pair()
    traces = writer.keyspace.shard(0).traces("stats:5")
    await writer.redis.hset(traces, "not", "a string")  # WRONGTYPE for both scripts
    touch_in_span(writer, "stats:5", "request")
    await writer.flush()  # the touch is written, its context is not
    [refresh] = await refresh_spans(exporter, 1)
    assert [c.key for c in handlers.calls] == ["stats:5"]
    assert linked(refresh) == []
    assert dict(refresh.attributes or {})["coalescer.key"] == "stats:5"


async def test_with_no_tracer_provider_a_touch_keeps_no_trace(
        pair: Callable[[], Awaitable[Pair]]) -> None:
    writer, _, _ = await pair()
    with trace.get_tracer("app").start_as_current_span("request"):
        writer.touch("stats:4", delay=3600)  # no refresh takes anything meanwhile
    await writer.flush()
    assert await writer.redis.exists(writer.keyspace.shard(0).meta)
    assert await writer.redis.keys(f"{writer.config.namespace}:*traces*") == []


# redis-py imports OpenTelemetry itself when it is installed: what coalescer adds is
# compared with what importing redis-py alone brings.
WRITER = """\
import asyncio, sys
import redis.asyncio

def otel():  # OpenTelemetry, and the tracing modules that use it (bounds holds numbers)
    return {m for m in sys.modules if m.startswith(("opentelemetry", "coalescer.tracing."))
            and m != "coalescer.tracing.bounds"}

before = otel()
from coalescer import Coalescer
from coalescer.config.rules import Config

async def main():
    config = Config.from_yaml(sys.argv[1])
    async with Coalescer(config, redis_url=sys.argv[2], worker=False) as c:
        for i in range(100):
            c.touch(f"stats:{i}")
        await c.flush()
    print(sorted(otel() - before))

asyncio.run(main())
"""


def test_a_writer_without_opentelemetry_imported_never_imports_it(
        namespace: str, redis_url: str, rules_file: Any, tmp_path: Any) -> None:
    path = rules_file(RULES.format(ns=namespace), "async def refresh(claim):\n    pass\n"
                      "async def refresh_batch(claims):\n    return []\n")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    done = subprocess.run([sys.executable, str(script), str(path), redis_url],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


STREAM_RULES = RULES + """\
sources:
  - name: events
    stream: "{ns}:events"
    key: "stats:{{customer}}"
    start: all
"""


async def test_a_stream_entry_carries_its_producers_context_to_the_refresh(
        exporter: InMemorySpanExporter, namespace: str, redis_url: str, rules_file: Any,
        start: Any) -> None:
    path = rules_file(STREAM_RULES.format(ns=namespace), HANDLERS)
    node = await start(path, redis_url=redis_url)
    with trace.get_tracer("app").start_as_current_span("publish") as span:
        producer = span.get_span_context()
    sent = f"00-{producer.trace_id:032x}-{producer.span_id:016x}-01"
    await node.redis.xadd(f"{namespace}:events", {"customer": "9", "traceparent": sent})
    await node.redis.xadd(f"{namespace}:events", {"customer": "9", "traceparent": "bad"})
    await node.redis.xadd(f"{namespace}:events", {"customer": "9"})
    [refresh] = await refresh_spans(exporter, 1)
    assert dict(refresh.attributes or {})["coalescer.key"] == "stats:9"
    assert linked(refresh) == [ids(producer)]
