"""Tracing with OpenTelemetry (the ``otel`` extra): a touch records its caller's span
context, and the refresh it caused links to it.

On only when the application has imported OpenTelemetry and set a tracer provider
before the coalescer starts; otherwise nothing here imports OpenTelemetry, and a touch
costs one attribute test more. See docs/operations.md "Tracing".

It may import the store's types (for type checking) and ``claim``; write, worker and the
facade import it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coalescer.store.keys import KeySpace
    from coalescer.store.scripts import Scripts
    from coalescer.tracing.refreshes import RefreshTracer
    from coalescer.tracing.touches import TouchTraces

from coalescer.tracing.bounds import KEEP


def enabled() -> bool:
    """Whether the application set an OpenTelemetry tracer provider (never imports it)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def touch_traces() -> TouchTraces | None:
    """The recorder of touches' span contexts, or None with tracing off."""
    if not enabled():
        return None
    from coalescer.tracing.touches import TouchTraces
    return TouchTraces(KEEP)


def refresh_tracer(scripts: Scripts, keyspace: KeySpace) -> RefreshTracer | None:
    """What traces a node's refreshes, or None with tracing off. With it on, the node's
    acks delete the trace contexts of the keys they finish."""
    if not enabled():
        return None
    from coalescer.tracing.refreshes import RefreshTracer
    scripts.traced = True
    return RefreshTracer(scripts, keyspace)
