"""A timeline (query/timeline.py) as lines a person reads: one event a line, oldest
first, then the key's kept trace links and the answer for ``--at``."""

from __future__ import annotations

from typing import Any

from coalescer.common.plural import plural
from coalescer.common.printable import printable_values
from coalescer.query.history import clock, format_duration_ms

_REASONS = {"window": "by its window", "max_wait": "forced by max_wait (the burst kept "
            "going)", "retry": "a retry", "scheduled": "at its own time",
            "requeued": "re-queued",
            "leading": "at once: the first touch of a quiet key (the leading edge)"}


def _touches(e: dict[str, Any]) -> str:
    when = ("in this second" if e.get("until_ms") is None
            else f"from then to {clock(e['until_ms'])}")
    if e["count"] is None:
        return f"touched {when}"
    return f"touched {plural(e['count'], 'time')} {when}"


def _claim(e: dict[str, Any]) -> str:
    line = (f"claimed by node {e['node'] or '(unknown)'}, token {e['token']}, attempt "
            f"{e['attempt']}; due {clock(e['due_ms'])}, "
            f"{_REASONS.get(e['due_reason'] or '', 'due')}")
    if e["touches"] is not None:
        line += f"; {plural(e['touches'], 'touch', 'touches')}"
    if e["items"] is not None:
        line += f", {plural(e['items'], 'item')}" + (" (overflowed)"
                                                     if e["items_overflowed"] else "")
    return line


def _outcome(e: dict[str, Any]) -> str:
    took = "" if e["duration_ms"] is None else f" in {format_duration_ms(e['duration_ms'])}"
    line = f"{e['outcome']}{took} (token {e['token']}"
    line += f", batch of {e['batch']})" if e["batch"] else ")"
    nxt = e["next"]
    if nxt is not None and nxt["due_ms"] is not None:
        line += ("; touched while it ran: runs again" if nxt["kind"] == "again"
                 else "; retry") + f", due {clock(nxt['due_ms'])}"
    if nxt is not None and nxt["kind"] == "dead":
        line += "; dead-lettered"
    return line + (f"\n{'':<27}error: {e['error']}" if e["error"] else "")


def event_line(e: dict[str, Any]) -> str:
    """One event, its time first."""
    kind = e["type"]
    text = (_touches(e) if kind == "touches"
            else f"scheduled for {clock(e['due_ms'])}" if kind == "scheduled"
            else _claim(e) if kind == "claim" else _outcome(e))
    at = e["second_ms"] if kind == "touches" else e["at_ms"]
    return f"  {clock(at)}  {text}"


def _trace_lines(traces: dict[str, Any]) -> list[str]:
    def shown(link: dict[str, Any]) -> str:
        return link["url"] or f"trace {link['trace_id']}"

    lines = [f"  touch     {shown(t)}" for t in traces["touches"]]
    if traces["touches_left_out"]:
        lines.append(f"  ({plural(traces['touches_left_out'], 'touch', 'touches')} "
                     "between them left out)")
    if traces["failed_try"]:
        lines.append(f"  failed try {shown(traces['failed_try'])}")
    return lines


def format_timeline(info: dict[str, Any]) -> str:
    """A timeline dict as readable lines (control characters escaped)."""
    info = printable_values(info)
    kept = info["kept"]
    lines = [f"{info['key']}  (rule {info['rule']}, shard {info['shard']}; state "
             f"{info['state']['state']})"]
    events = info["events"]
    if events:
        lines.append(f"events, oldest first (the last {kept['events']} are kept, for "
                     f"{kept['for_ms'] // 60_000} min after the newest):")
        lines += [event_line(e) for e in events]
    else:
        lines.append("no events recorded (none yet, or none in the last "
                     f"{kept['for_ms'] // 60_000} min)")
    traces = _trace_lines(info["traces"])
    if traces:
        lines += ["trace links:", *traces]
    if "at" in info:
        lines.append(f"at {clock(info['at']['at_ms'])}: {info['at']['answer']}")
    return "\n".join(lines)
