"""Links to a tracing UI, built from a URL template, for the span contexts coalescer
keeps beside a key (store/lua/traces_put.lua): its touches' (the first and last few of
its burst) and its last failed try's.

The template (``--trace-url`` or ``COALESCER_TRACE_URL``, e.g.
``https://jaeger.example/trace/{trace_id}``) holds ``{trace_id}`` and optionally
``{span_id}``, and nothing else in braces; it is checked once, by its length first.
"""

from __future__ import annotations

import re
from typing import Any

from coalescer.common.traceparent import MAX_TRACEPARENT

ENV_TRACE_URL = "COALESCER_TRACE_URL"
MAX_TEMPLATE = 2048  # characters
PLACES = ("{trace_id}", "{span_id}")
_BRACED = re.compile(r"\{[^{}]*\}")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def check_template(template: str) -> str:
    """``template`` if it makes trace links, else ValueError naming what is wrong."""
    if len(template) > MAX_TEMPLATE:
        raise ValueError(f"the trace URL template is {len(template)} characters long, "
                         f"over the limit of {MAX_TEMPLATE}")
    if "{trace_id}" not in template:
        raise ValueError(f"the trace URL template {template!r} has no {{trace_id}} "
                         "(e.g. https://jaeger.example/trace/{trace_id})")
    unknown = [p for p in _BRACED.findall(template) if p not in PLACES]
    if unknown or template.count("{") != template.count("}"):
        raise ValueError(f"the trace URL template {template!r} has "
                         + (f"an unknown placeholder {unknown[0]}" if unknown
                            else "an unmatched brace")
                         + ": only {trace_id} and {span_id} are filled in")
    return template


def link(template: str | None, traceparent: str) -> dict[str, Any] | None:
    """A traceparent as {"trace_id", "span_id", "url"} (url None without a template),
    or None when it does not read."""
    if len(traceparent) > MAX_TRACEPARENT:
        return None
    found = _TRACEPARENT.fullmatch(traceparent.strip())
    if found is None:
        return None
    trace_id, span_id = found.groups()
    url = None if template is None else (
        template.replace("{trace_id}", trace_id).replace("{span_id}", span_id))
    return {"trace_id": trace_id, "span_id": span_id, "url": url}


def kept_links(value: str | None, template: str | None) -> dict[str, Any]:
    """The links of a key's kept trace contexts ("DROPPED|FIRST|LAST|TRIED", see
    traces_put.lua): {"touches": [...], "touches_left_out": N, "failed_try": link or
    None}."""
    parts = (value or "0|||").split("|", 3)
    dropped, first, last, tried = parts + [""] * (4 - len(parts))
    touches = [found for tp in f"{first},{last}".split(",") if tp
               if (found := link(template, tp)) is not None]
    return {"touches": touches,
            "touches_left_out": int(dropped) if dropped.isdigit() else 0,
            "failed_try": link(template, tried) if tried else None}
