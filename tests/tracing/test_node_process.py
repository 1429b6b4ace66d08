"""Tracing across processes: a writer (this test) touches inside its spans; a
`coalescer run` node process, whose handler module sets up the real SDK with an
exporter writing each span to a file, runs the refresh as a span linked to them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coalescer import Coalescer
from coalescer.config.rules import Config
from tests.helpers.e2e import NodeProcs
from tests.helpers.servers import wait_until

HANDLERS = """\
import json
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class ToFile(SpanExporter):
    def export(self, spans):
        with open(os.environ["SPANS_FILE"], "a") as out:
            for s in spans:
                out.write(json.dumps({
                    "name": s.name, "kind": s.kind.name, "root": s.parent is None,
                    "links": [[f"{l.context.trace_id:032x}", f"{l.context.span_id:016x}"]
                              for l in s.links],
                    "count": s.attributes.get("messaging.batch.message_count")}) + "\\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(ToFile()))
trace.set_tracer_provider(provider)


async def refresh(claim):
    pass
"""

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 100ms
    absorb: 1ms
    handler: handlers:refresh
"""


@pytest.fixture
def writer_tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield
    provider.shutdown()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeProcs]:
    procs = NodeProcs(tmp_path)
    yield procs
    procs.stop_all()


def spans_in(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.mark.usefixtures("writer_tracing")
async def test_a_node_process_links_its_refresh_to_the_writers_touches(
        nodes: NodeProcs, namespace: str, redis_url: str, rules_file: Any,
        tmp_path: Path) -> None:
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    spans_file = tmp_path / "spans.jsonl"
    nodes.start(path, redis_url, "n1", SPANS_FILE=str(spans_file))
    tracer = trace.get_tracer("app")
    async with Coalescer(Config.from_yaml(path), redis_url=redis_url, worker=False) as writer:
        sent = []
        for name in ("request 1", "request 2"):
            with tracer.start_as_current_span(name) as span:
                writer.touch("stats:1")
                ctx = span.get_span_context()
                sent.append([f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"])
            await writer.flush()

    def refreshed() -> list[dict[str, Any]]:
        return [s for s in spans_in(spans_file) if s["name"] == "process stats"]
    [span] = await wait_until(refreshed, timeout=30, message=nodes.log("n1"))
    assert span["kind"] == "CONSUMER" and span["root"]
    assert span["links"] == sent
    assert span["count"] == 2
