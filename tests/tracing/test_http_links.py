"""Tracing through the HTTP API: a POST /touch carrying a ``traceparent`` header (the
caller's W3C trace context) is kept with the keys it touches, and their refresh links to
it (a real node and its HTTP API, the SDK's in-memory exporter)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.tracing.test_refresh_spans import exporter, ids, linked, refresh_spans  # noqa: F401
from tests.web.test_api import NodeFactory, make_node  # noqa: F401 (make_node: a fixture)


async def test_a_touch_over_http_links_its_refresh_to_the_callers_trace(
        exporter: InMemorySpanExporter, make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node()
    with trace.get_tracer("client").start_as_current_span("client request") as span:
        caller = span.get_span_context()
    header = f"00-{caller.trace_id:032x}-{caller.span_id:016x}-01"
    assert await node.touch({"keys": ["stats:user:1"]},
                            headers={"traceparent": header}) == (202, {"accepted": 1})
    assert await node.touch({"keys": ["stats:user:1"]},
                            headers={"traceparent": "not-a-trace"}) == (202, {"accepted": 1})
    [refresh] = await refresh_spans(exporter, 1)
    assert dict(refresh.attributes or {})["coalescer.key"] == "stats:user:1"
    assert linked(refresh) == [ids(caller)]
