"""A key's timeline as the scripts record it (store/lua/_lib.lua), read into events.

The scripts keep a key's last ``EVENTS`` events in a list that expires ``KEEP_MS`` after
its last one, written by the calls that already run: a claim, a claim's end (ack or
fail), and, once the key has a timeline (from its first claim on), a touch in a new
second of a burst and a touch with a time of its own. A second's touch count is the
difference between the burst's counts at the seconds' boundaries (its first touch and
the claim or the pending state close it): a touch within a second costs no write of its
own, and a key never claimed none at all (its burst before its first claim is one
entry from its first touch to its last, with their count).

Each event read is a dict (the JSON of ``coalescer timeline KEY --json``; its fields:
docs/http.md, "GET /keys/{key}/timeline"), ``at_ms`` its server-clock time, ``type``
one of touches, scheduled, claim and outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

EVENTS = 32  # TIMELINE_EVENTS in store/lua/_lib.lua
KEEP_MS = 3_600_000  # TIMELINE_KEEP_MS in store/lua/_lib.lua

# Why a claim was due, from its burst and its rule (query/explain.py due_reason).
DueReason = Callable[[int, int, int, int], str]


def _int(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


@dataclass(frozen=True, slots=True)
class Burst:
    """A burst's touches as a claim or a pending state tells them."""

    first_ms: int
    last_ms: int
    count: int | None
    retry: bool = False  # a retry's claim: its touches were shown with the first try's
    scheduled_ms: int | None = None  # a pending key's own time (its first touch set it)


def _claim(fields: list[str], at: int) -> dict[str, Any] | None:
    if len(fields) < 10:
        return None
    scheduled = fields[6].startswith("S")
    fields[6] = fields[6].removeprefix("S")
    token, first, last, attempt, due, count, items = (_int(f) for f in fields[2:9])
    if token is None or first is None or last is None or due is None:
        return None
    return {"type": "claim", "at_ms": at, "token": token, "node": "|".join(fields[9:]),
            "attempt": attempt, "due_ms": due, "due_reason": "scheduled" if scheduled
            else None, "first_touch_ms": first,
            "last_touch_ms": last, "touches": count, "items": items,
            "items_overflowed": fields[8].endswith("+")}


def _next(text: str) -> dict[str, Any] | None:
    kind, _, due = text.partition("@")
    if kind == "dead":
        return {"kind": "dead", "due_ms": None}
    if kind in ("again", "retry") and _int(due) is not None:
        return {"kind": kind, "due_ms": int(due)}
    return None


def _outcome(fields: list[str], at: int) -> dict[str, Any] | None:
    if len(fields) < 9 or _int(fields[2]) is None:
        return None
    return {"type": "outcome", "at_ms": at, "token": int(fields[2]), "outcome": fields[3],
            "start_ms": _int(fields[4]), "duration_ms": _int(fields[5]),
            "batch": _int(fields[6]) or 0, "next": _next(fields[7]),
            "error": "|".join(fields[8:])}


def parse_event(raw: str) -> dict[str, Any] | None:
    """One recorded event (see store/lua/_lib.lua), or None when it does not read.
    Touch boundaries come back as {"type": "boundary", "at_ms", "before"}."""
    fields = raw.split("|")
    at = _int(fields[1]) if len(fields) > 1 else None
    if at is None:
        return None
    kind = fields[0]
    if kind == "t" and len(fields) == 3:
        return {"type": "boundary", "at_ms": at, "before": _int(fields[2])}
    if kind == "s" and len(fields) == 3 and _int(fields[2]) is not None:
        return {"type": "scheduled", "at_ms": at, "due_ms": int(fields[2])}
    if kind == "c":
        return _claim(fields, at)
    if kind == "o":
        return _outcome(fields, at)
    return None


def _bucket(at: int, count: int | None, until: int | None = None) -> dict[str, Any]:
    spans = until is not None and until // 1000 != at // 1000
    return {"type": "touches", "at_ms": at, "second_ms": at // 1000 * 1000, "count": count,
            "until_ms": until if spans else None}


def touch_buckets(burst: Burst, boundaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The burst's touches by second: its first touch's second, then one per boundary
    (a touch in a new second), each counted from the counts at its ends."""
    marks: list[tuple[int, int | None]] = [] if burst.retry else [(burst.first_ms, 0)]
    marks += [(b["at_ms"], b["before"]) for b in boundaries]
    ends = [before for _, before in marks[1:]] + [burst.count]
    out = []
    for i, ((at, before), end) in enumerate(zip(marks, ends, strict=True)):
        count = end - before if before is not None and end is not None else None
        last = burst.last_ms if i == len(marks) - 1 else None  # no boundary after it
        out.append(_bucket(at, count if count is None or count > 0 else None, last))
    return out


def _due_reason(claim: dict[str, Any], scheduled: list[dict[str, Any]],
                reason: DueReason) -> str:
    if (claim["attempt"] or 1) > 1:
        return "retry"
    if claim["due_reason"] == "scheduled" or any(
            s["due_ms"] == claim["due_ms"] or s["at_ms"] >= claim["first_touch_ms"]
            for s in scheduled):
        return "scheduled"
    return reason(claim["first_touch_ms"], claim["last_touch_ms"], 0, claim["due_ms"])


def build_events(raw: Sequence[str], pending: Burst | None,
                 reason: DueReason) -> list[dict[str, Any]]:
    """The timeline's events, oldest first, touches grouped by second: ``raw`` as the
    scripts recorded them, closed by ``pending`` (the key's pending burst, if any)."""
    parsed = [e for e in (parse_event(r) for r in raw) if e is not None]
    parsed.sort(key=lambda e: e["at_ms"])
    out: list[dict[str, Any]] = []
    boundaries: list[dict[str, Any]] = []
    scheduled: list[dict[str, Any]] = []
    for event in parsed:
        if event["type"] == "boundary":
            boundaries.append(event)
            continue
        if event["type"] == "scheduled":
            scheduled.append(event)
        elif event["type"] == "claim":
            burst = Burst(event["first_touch_ms"], event["last_touch_ms"], event["touches"],
                          retry=(event["attempt"] or 1) > 1)
            out += _close(burst, boundaries)
            event["due_reason"] = _due_reason(event, scheduled, reason)
            boundaries, scheduled = [], []
        out.append(event)
    if pending is not None:
        out += _close(pending, boundaries)
        if pending.scheduled_ms is not None and not any(
                s["due_ms"] == pending.scheduled_ms for s in scheduled):
            out.append({"type": "scheduled", "at_ms": pending.first_ms,
                        "due_ms": pending.scheduled_ms})
    else:
        out += [_bucket(b["at_ms"], None) for b in boundaries]
    out.sort(key=lambda e: e["at_ms"])
    return out


def _close(burst: Burst, boundaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The buckets of ``burst``, and uncounted ones for boundaries outside it (a burst
    whose claim is no longer kept, or that a cancel dropped)."""
    inside = [b for b in boundaries if burst.first_ms <= b["at_ms"] <= burst.last_ms]
    outside = [_bucket(b["at_ms"], None) for b in boundaries
               if not burst.first_ms <= b["at_ms"] <= burst.last_ms]
    return outside + touch_buckets(burst, inside)


def runs(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim with its outcome (None while it runs or when none was recorded), oldest
    first."""
    ends = {e["token"]: e for e in events if e["type"] == "outcome"}
    out = []
    for claim in (e for e in events if e["type"] == "claim"):
        end = ends.get(claim["token"])
        out.append({"token": claim["token"], "node": claim["node"],
                    "claimed_ms": claim["at_ms"], "attempt": claim["attempt"],
                    "due_ms": claim["due_ms"], "due_reason": claim["due_reason"],
                    "touches": claim["touches"], "items": claim["items"],
                    "outcome": end["outcome"] if end else None,
                    "start_ms": end["start_ms"] if end else None,
                    "duration_ms": end["duration_ms"] if end else None,
                    "finished_ms": end["at_ms"] if end else None,
                    "next": end["next"] if end else None,
                    "error": end["error"] if end else ""})
    return out
