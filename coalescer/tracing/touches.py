"""The span contexts of touches made in this process and not yet written to Redis:
per key, the first and last few of its burst, and how many were left out between.

Bounded: at most ``MAX_KEYS`` keys (the contexts of further keys are counted in
``refused``, not kept), and a key's contexts not taken by a write within ``STALE``
seconds are dropped (``sweep``): the key was refused, or its write keeps failing.
A touch refused (quota, back-pressure, a key no rule takes) leaves nothing here."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, TraceFlags
from opentelemetry.trace import propagation as otel_propagation

from coalescer.common.traceparent import MAX_TRACEPARENT
from coalescer.tracing.bounds import MAX_KEYS

STALE = 60.0  # seconds a key's contexts wait here at most for its write

# The current span, read straight from the context variable OpenTelemetry keeps the
# current context in (an eighth of trace.get_current_span()'s cost, which the touch path
# would pay on every call); the public calls where this API version differs.
_SPAN_KEY: str = getattr(otel_propagation, "_SPAN_KEY", "")
_VAR = getattr(getattr(otel_context, "_RUNTIME_CONTEXT", None), "_current_context", None)
_current_context: Callable[[], Any] = (_VAR.get if isinstance(_VAR, ContextVar)
                                       else otel_context.get_current)


def span_context(text: str) -> SpanContext | None:
    """The span context of a W3C traceparent string; None when it does not read (one
    longer than MAX_TRACEPARENT characters is not read at all)."""
    if len(text) > MAX_TRACEPARENT:
        return None
    parts = text.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        ctx = SpanContext(int(parts[1], 16), int(parts[2], 16), is_remote=True,
                          trace_flags=TraceFlags(int(parts[3], 16) & 0xFF))
    except ValueError:
        return None
    return ctx if ctx.is_valid else None


def traceparent(ctx: SpanContext) -> str:
    """``ctx`` as a W3C traceparent string."""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@dataclass(slots=True)
class _Burst:
    span: Span  # the span of the last touch recorded
    first: list[SpanContext]
    last: deque[SpanContext]
    since: float  # time.monotonic() when the first was recorded
    dropped: int = 0  # touches counted, not linked (past the kept ones)

    def encoded(self) -> str:
        """The form store/lua/traces_put.lua merges: "DROPPED|FIRST|LAST|"."""
        return (f"{self.dropped}|{','.join(map(traceparent, self.first))}|"
                f"{','.join(map(traceparent, self.last))}|")


class TouchTraces:
    """Records the caller's span context with each touched key (none outside a span).
    A key touched again within the same span is recorded once."""

    def __init__(self, keep: int, *, max_keys: int = MAX_KEYS, stale: float = STALE) -> None:
        self._keep = keep
        self._max_keys = max_keys
        self._stale = stale
        self._keys: dict[str, _Burst] = {}  # in the order of their first context
        self.refused = 0  # contexts not kept: ``max_keys`` keys had some already
        self.record: Callable[[str], None] = self._recorder()
        """Record the current span's context with ``key`` (the touch path: a closure
        over what it reads, cheaper than a method)."""

    def _recorder(self) -> Callable[[str], None]:
        burst_of, add = self._keys.get, self._add
        current, span_key = _current_context, _SPAN_KEY

        def record(key: str) -> None:
            span = current().get(span_key)
            if span is not None:
                burst = burst_of(key)
                if burst is None or burst.span is not span:
                    add(key, burst, span)

        def record_public(key: str) -> None:  # an API version without the span key
            span = trace.get_current_span()
            burst = burst_of(key)
            if burst is None or burst.span is not span:
                add(key, burst, span)
        return record if span_key else record_public

    def record_remote(self, key: str, text: str) -> None:
        """Record a producer's context (a W3C traceparent string) with ``key``; one
        that does not read is left out."""
        ctx = span_context(text)
        if ctx is not None:
            self._add(key, self._keys.get(key), trace.NonRecordingSpan(ctx))

    def _add(self, key: str, burst: _Burst | None, span: Span) -> None:
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return
        if burst is None:
            if len(self._keys) >= self._max_keys:
                self.refused += 1
                return
            self._keys[key] = _Burst(span, [ctx], deque(maxlen=self._keep), time.monotonic())
            return
        burst.span = span
        if len(burst.first) < self._keep:
            burst.first.append(ctx)
            return
        if len(burst.last) == self._keep:
            burst.dropped += 1
        burst.last.append(ctx)

    def take(self, keys: Iterable[str]) -> dict[str, str]:
        """The recorded contexts of ``keys`` (those that have some), encoded; forgotten
        here."""
        out, pop = {}, self._keys.pop
        for key in keys:
            burst = pop(key, None)
            if burst is not None:
                out[key] = burst.encoded()
        return out

    def forget(self, keys: Iterable[str]) -> None:
        """Drop the recorded contexts of ``keys`` (refused, dropped or cancelled)."""
        pop = self._keys.pop
        for key in keys:
            pop(key, None)

    def sweep(self, now: float | None = None) -> int:
        """Drop the contexts recorded more than ``stale`` seconds ago and not taken by a
        write (their key was refused, or its write keeps failing); returns how many keys'.
        The oldest come first, so this looks only at those it drops and one more."""
        cutoff = (time.monotonic() if now is None else now) - self._stale
        keys, swept = self._keys, 0
        while keys:
            try:
                key = next(iter(keys))
            except (StopIteration, RuntimeError):  # emptied or changed by another thread
                break
            burst = keys.get(key)
            if burst is not None and burst.since > cutoff:
                break
            keys.pop(key, None)
            swept += 1
        return swept

    def __len__(self) -> int:
        """Keys whose contexts are held here."""
        return len(self._keys)
