"""`coalescer timeline KEY` and GET /keys/{key}/timeline: a key's recent events, and
which refresh covered a write made at a given time.

One pipelined round trip to the key's shard (both of its shards while a reshard runs)
reads the server clock (apart on a Redis Cluster, whose pipelines refuse TIME), its
state, its timeline (at most ``EVENTS`` entries) and its kept trace contexts: the answer
takes the same time whatever the number of keys pending.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from coalescer.config.rules import Config, Rule
from coalescer.query.explain import KeyRead, describe_state, due_reason
from coalescer.query.history import clock
from coalescer.query.timeline_events import (
    EVENTS,
    KEEP_MS,
    Burst,
    DueReason,
    build_events,
    runs,
)
from coalescer.query.trace_links import kept_links
from coalescer.store import key_states as states

MAX_AT_TEXT = 64  # characters of an --at time, at most
AT_FORMS = ("epoch seconds (1733462400.5) or an ISO 8601 time (2026-12-06T04:30:00, "
            "local time unless it has an offset such as +00:00 or Z)")


def parse_at(text: str) -> int:
    """Server-clock epoch ms of ``text`` (see AT_FORMS); ValueError naming what is wrong.
    A text longer than MAX_AT_TEXT characters is refused by its length, unread."""
    if len(text) > MAX_AT_TEXT:
        raise ValueError(f"the time is {len(text)} characters long, over the limit of "
                         f"{MAX_AT_TEXT}: expected {AT_FORMS}")
    stripped = text.strip()
    try:
        seconds = float(stripped)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(stripped.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{text!r} is not a time: expected {AT_FORMS}") from None
        seconds = moment.timestamp()  # a naive time is local time
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{text!r} is not a time: expected {AT_FORMS}, not before 1970")
    return round(seconds * 1000)


def _pending_burst(value: str | None) -> Burst | None:
    """The burst a pending key's state holds, or the touches kept to re-arm a running
    key (uncounted), or None."""
    if states.kind(value) == "pending":
        p = states.pending(value or "")
        return None if p is None else Burst(p.first_ms, p.last_ms, p.touches,
                                            scheduled_ms=p.due_ms if p.scheduled else None)
    if states.kind(value) == "running":
        fields = states.fields(value or "", 9)
        first, last = fields[7], fields[8]
        if first.isdigit() and last.isdigit():
            return Burst(int(first), int(last), None)
    return None


def _reason(rule: Rule) -> DueReason:
    return lambda first, last, attempts, due: due_reason(rule, first, last, attempts, due)


async def gather_timeline(redis: Any, config: Config, key: str, *, at_ms: int | None = None,
                          trace_url: str | None = None) -> dict[str, Any]:
    """``key``'s timeline; UnknownKeyError if no rule matches it, InvalidKeyError for a
    key over the length limit. ``at_ms``: also answer which refresh covered a write then.
    ``trace_url``: a checked template (query/trace_links.py) for trace links."""
    read = await KeyRead.start(redis, config, key)
    rule, space, home = read.rule, read.space, read.shard.shard
    read.pipe.get(read.shard.traces(key))
    for n in space.homes(key):
        read.pipe.lrange(space.shard(n).timeline(key), 0, -1)
    now, (value, inflight, dead, traces, *lists) = await read.execute()
    raw = [entry for entries in lists for entry in entries]
    events = build_events(raw, _pending_burst(value), _reason(rule))
    info: dict[str, Any] = {
        "key": key, "rule": rule.name, "shard": home, "now_ms": now,
        "kept": {"events": EVENTS, "for_ms": KEEP_MS, "recorded": len(raw)},
        "state": describe_state(value, rule, {"inflight": inflight, "dead": dead}, now),
        "events": events, "runs": runs(events),
        "traces": kept_links(traces, trace_url)}
    if at_ms is not None:
        info["at"] = covered_at(at_ms, info)
    return info


# -- "which refresh covered my write at T?" ------------------------------------------------


def _run_words(run: dict[str, Any]) -> str:
    return (f"the refresh claimed at {clock(run['claimed_ms'])} (token {run['token']}, "
            f"node {run['node'] or '(unknown)'}, attempt {run['attempt']})")


def _after_failure(run: dict[str, Any], later: list[dict[str, Any]]) -> tuple[str, str]:
    """The status and words of a first run after T that did not succeed."""
    words = f"{_run_words(run)} {run['outcome']}"
    words += f": {run['error']}" if run["error"] else ""
    fixed = next((r for r in later if r["outcome"] == "success"), None)
    if fixed is not None:
        return "covered", f"covered after a failure: {words}; then {_run_words(fixed)} " \
                          f"succeeded in {fixed['duration_ms']} ms"
    nxt = run["next"]
    if nxt is not None and nxt["kind"] == "dead":
        return "failed", f"not refreshed: {words}, and the key was dead-lettered"
    if nxt is not None:
        return "failed", (f"not refreshed yet: {words}; it runs again, due at "
                          f"{clock(nxt['due_ms'])}")
    return "failed", f"not refreshed: {words}"


def _covered_by(run: dict[str, Any], later: list[dict[str, Any]],
                state: dict[str, Any]) -> tuple[str, str]:
    if run["outcome"] == "success":
        return "covered", (f"covered by {_run_words(run)}: started "
                           f"{clock(run['start_ms'] or run['claimed_ms'])}, succeeded in "
                           f"{run['duration_ms']} ms")
    if run["outcome"] is None:
        running = state.get("running") or {}
        if running.get("token") == run["token"]:
            return "running", f"being refreshed now by {_run_words(run)}"
        return "unknown", (f"{_run_words(run)} has no recorded end (its node may have "
                           "stopped: the claim is recovered after its lease)")
    return _after_failure(run, later)


def _not_yet(state: dict[str, Any], now: int) -> tuple[str, str]:
    """No run claimed after T: the words for the key's state now."""
    kind = state["state"]
    if kind in ("pending", "backoff"):
        due = state["due_ms"]
        when = "now" if due <= now else f"in {(due - now) / 1000:.1f} s"
        reason = state.get("due_reason") or "window"
        return "pending", (f"not yet refreshed: {kind}, due at {clock(due)} ({when}, by "
                           f"{reason.replace('_', ' ')})")
    if kind == "running":
        again = state["running"].get("touched_again")
        if again:
            return "pending", ("not yet refreshed: the run in progress was claimed before "
                               f"that time; the key runs again, due at "
                               f"{clock(again['due_ms'])}")
        return "unknown", ("not refreshed by a run claimed after that time: the run in "
                           "progress was claimed before it, and no later touch is pending")
    if kind == "dead":
        return "dead", f"not refreshed: dead-lettered: {state['dead']['error']}"
    return "unknown", ("no refresh claimed after that time is recorded, and nothing is "
                       "pending: no touch of the key at or after it reached Redis, or its "
                       "events are no longer kept")


def covered_at(at_ms: int, info: dict[str, Any]) -> dict[str, Any]:
    """Which refresh covered a write made at ``at_ms`` (server clock): the first run
    whose claim came after it, and its outcome; or why none has yet."""
    now, all_runs = info["now_ms"], info["runs"]
    later = [r for r in all_runs if r["claimed_ms"] > at_ms]
    if at_ms > now:
        status, words = "future", f"{clock(at_ms)} is after the server's clock now " \
                                  f"({clock(now)})"
    elif later:
        status, words = _covered_by(later[0], later[1:], info["state"])
    else:
        status, words = _not_yet(info["state"], now)
    oldest = min((e["at_ms"] for e in info["events"]), default=None)
    kept = info["kept"]
    maybe_lost = kept["recorded"] >= kept["events"] or now - at_ms > kept["for_ms"]
    if status not in ("future", "pending", "dead") and maybe_lost and (
            oldest is None or oldest > at_ms):
        words += (f" (the timeline starts at {clock(oldest)}: an earlier refresh may no "
                  "longer be recorded)" if oldest is not None else
                  " (no events are recorded for this key)")
    return {"at_ms": at_ms, "status": status, "answer": words,
            "run": later[0] if later else None}
