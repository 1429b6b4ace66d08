"""What `coalescer status`, GET /status and the gauges report, read from Redis."""

from __future__ import annotations

from collections import Counter
from typing import Any

from coalescer.common.plural import plural
from coalescer.common.printable import printable_values
from coalescer.config.rules import Config
from coalescer.query.controls import paused_rules
from coalescer.query.fair_status import add_fair, format_fair
from coalescer.query.history import RECENT, recent_by_rule
from coalescer.query.layout_read import read_layout
from coalescer.query.rate_status import add_rates, format_rates
from coalescer.query.registry_status import add_registry, format_registry
from coalescer.query.rule_counts import DEAD_LISTED, new_entry, queue_rule, read_rule
from coalescer.query.scheduled_keys import add_scheduled
from coalescer.query.source_status import add_sources, format_sources
from coalescer.query.workers import NO_WORKER, mark_unread, status_worker_lines
from coalescer.store.eviction import policy_lines, policy_status
from coalescer.store.hints import CommandHints
from coalescer.store.keys import ShardKeys
from coalescer.store.layout import LayoutInfo
from coalescer.store.replicas import durability_lines, durability_status

SHOWN_RANGES = 8  # unled shard ranges the summary lists before "and N more"
SHOWN_LEADERS = 6  # nodes the summary names before "N more nodes lead M"
RECENT_TOTAL = 2000  # history entries status reads at most, over every shard
LAPSED = "lease lapsed, takeover pending"  # a leader whose node lease ended
PAUSED = "  paused: no key runs until it is resumed"  # the row of a paused rule


def recent_per_shard(shards: int) -> int:
    """How many of each shard's newest refreshes the recent failure rate reads."""
    return max(1, min(RECENT, RECENT_TOTAL // max(1, shards)))


def _leader_node(value: str | None) -> str | None:
    """The node id of a lease value "EPOCH|NODE-ID"."""
    if not value:
        return None
    return value.split("|", 1)[1] if "|" in value else value


def _dead_entry(key: str, rule: str, since: float, meta: str | None) -> dict[str, Any]:
    parts = (meta or "").split("|", 4)
    attempts = int(parts[3]) if len(parts) > 3 and parts[0] == "D" else None
    error = parts[4] if len(parts) > 4 and parts[0] == "D" else ""
    return {"key": key, "rule": rule, "since_ms": int(since), "attempts": attempts, "error": error}


def _queue_shard(pipe: Any, sk: ShardKeys, rules: list[str]) -> None:
    """Queue one shard's reads: its leader, then each rule's (see rule_counts)."""
    pipe.get(sk.leader)
    for name in rules:
        queue_rule(pipe, sk, name)


async def gather_status(redis: Any, config: Config) -> dict[str, Any]:
    """Leader per shard, pending / in-flight / dead per rule, next due, dead letters.

    Two pipelined round trips whatever the shard count (one when nothing is dead):
    every count and head, then the state of the dead letters listed. A Redis
    Cluster pipeline sends each node the reads of its own slots.
    """
    layout = await read_layout(redis, config)
    space = layout.keyspace(config.namespace)
    names = [r.name for r in config.rules]
    rules: dict[str, dict[str, Any]] = {
        name: new_entry() for name in names}
    pipe = redis.pipeline(transaction=False)
    for sk in space.all_shards():
        _queue_shard(pipe, sk, names)
    replies = iter(await pipe.execute())
    shards: list[dict[str, Any]] = []
    listed: list[tuple[ShardKeys, str, str, float]] = []
    for sk in space.all_shards():
        leader = next(replies)
        shards.append({"shard": sk.shard, "leader": _leader_node(leader),
                       "epoch": int(leader.split("|", 1)[0]) if leader else None})
        for name in names:
            listed += [(sk, key, name, since) for key, since in read_rule(rules[name], replies)]
    dead = await _dead_letters(redis, listed[:DEAD_LISTED])
    recent = await recent_by_rule(redis, config, recent_per_shard(space.span), space)
    for name, counts in recent.items():
        rules[name]["recent"] = counts
    await add_scheduled(redis, config, space, rules)
    paused = set(await paused_rules(redis, config))
    for name in names:
        rules[name]["paused"] = name in paused
    status = {"namespace": config.namespace, "shards": shards, "rules": rules,
              "dead_letters": dead, "layout": layout_entry(layout)}
    await add_registry(redis, config, status)
    await add_sources(redis, config, status)
    mark_unread(status)
    await add_rates(redis, config, status)
    await add_fair(redis, config, status)
    status["memory"] = await policy_status(redis)
    status["durability"] = await durability_status(redis, config.durability)
    return status


async def _dead_letters(redis: Any,
                        listed: list[tuple[ShardKeys, str, str, float]]) -> list[dict[str, Any]]:
    if not listed:
        return []
    pipe = redis.pipeline(transaction=False)
    for sk, key, _, _ in listed:
        pipe.hget(sk.meta, key)
    metas = await pipe.execute()
    return [_dead_entry(key, rule, since, meta)
            for (_, key, rule, since), meta in zip(listed, metas, strict=True)]


def _when(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return "-"
    delta = (ms - now_ms) / 1000
    return f"in {delta:.1f}s" if delta >= 0 else f"{-delta:.1f}s ago"


def _scheduled_lines(status: dict[str, Any], now_ms: int) -> list[str]:
    """A line per rule with keys waiting for a time a touch set (none: no line)."""
    lines = []
    for name, r in status["rules"].items():
        if r.get("scheduled"):
            more = "at least " if r.get("scheduled_capped") else ""
            lines.append(f"{name}: {more}{plural(r['scheduled'], 'scheduled key')} of the "
                         f"pending, the next due {_when(r['next_scheduled_ms'], now_ms)}")
    return ["", *lines] if lines else []


def ranges(numbers: list[int], most: int = SHOWN_RANGES) -> str:
    """Sorted numbers as compact ranges: "0-127, 200, 300-511" (the first ``most``
    ranges, then how many more numbers)."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:most])
    rest = sum(b - a + 1 for a, b in spans[most:])
    return shown + (f" and {rest} more" if rest else "")


def shard_summary(shards: list[dict[str, Any]]) -> str:
    """One line: "shards: 512 — node-a leads 256, node-b leads 256; unled: none" (a
    leader whose node lease lapsed: "n1 leads 3 (lease lapsed, takeover pending)")."""
    counts = Counter(s["leader"] for s in shards if s["leader"])
    lapsed = {s["leader"] for s in shards if s.get("lease_lapsed")}
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    leads = [f"{node} leads {n}" + (f" ({LAPSED})" if node in lapsed else "")
             for node, n in ranked[:SHOWN_LEADERS]]
    if len(ranked) > SHOWN_LEADERS:
        others = ranked[SHOWN_LEADERS:]
        leads.append(f"{plural(len(others), 'more node')} lead {sum(n for _, n in others)}")
    unled = [s["shard"] for s in shards if not s["leader"]]
    return (f"shards: {len(shards)} — {', '.join(leads) or 'no leader anywhere'}; "
            f"unled: {ranges(unled) if unled else 'none'}")


def format_status(status: dict[str, Any], now_ms: int, *, every_shard: bool = False,
                  hints: CommandHints | None = None) -> str:
    """A readable summary of a status dict: a line for the shards (a row each with
    ``every_shard``), a row per rule, recent failures, the oldest dead letters.
    ``hints``: the options the commands it suggests need (see coalescer.store.hints).
    Keys, names and errors are shown with their control characters escaped."""
    status = printable_values(status)
    lines = [f"namespace {status['namespace']}", *layout_lines(status.get("layout"), now_ms),
             shard_summary(status["shards"]), *policy_lines(status),
             *durability_lines(status)]
    if every_shard:
        lines += ["", "SHARD  LEADER"]
        lines += [f"{s['shard']:<6} {_leader_text(s)}" for s in status["shards"]]
    lines += ["", f"{'RULE':<24} {'PENDING':>8} {'IN-FLIGHT':>10} {'DEAD':>6}  NEXT DUE"]
    for name, r in status["rules"].items():
        lines.append(f"{name:<24} {r['pending']:>8} {r['in_flight']:>10} {r['dead']:>6}  "
                     f"{_when(r['next_due_ms'], now_ms)}" + (PAUSED if r.get("paused") else "")
                     + (f"  {NO_WORKER}" if r.get("no_worker") else ""))
    lines += status_worker_lines(status, hints or CommandHints())
    lines += _scheduled_lines(status, now_ms)
    lines += format_rates(status)
    lines += format_fair(status)
    lines += format_registry(status)
    lines += _recent_lines(status)
    lines += format_sources(status)
    lines += _dead_lines(status, hints or CommandHints())
    return "\n".join(lines)


def layout_entry(layout: LayoutInfo) -> dict[str, Any]:
    """The status's ``layout``: the shard count, and the running or last reshard."""
    return {"generation": layout.gen, "shards": layout.shards,
            "resharding_from": layout.source or None,
            "drained": sorted(layout.drained) if layout.resharding else None,
            "last_from": layout.was or None, "began_ms": layout.began_ms or None,
            "ended_ms": layout.ended_ms or None, "moved": layout.moved}


def layout_lines(layout: dict[str, Any] | None, now_ms: int) -> list[str]:
    """A line while a reshard runs (how many old shards are drained), and one for the
    last reshard once it ended."""
    if not layout:
        return []
    source, shards = layout["resharding_from"], layout["shards"]
    if source:
        drained = len(layout["drained"] or ())
        return [f"resharding from {source} to {shards} shards (began "
                f"{_when(layout['began_ms'], now_ms)}): {drained} of {source} old shards "
                f"drained, {plural(layout['moved'], 'key')} moved so far"]
    if layout["last_from"] and layout["ended_ms"]:
        return [f"resharded from {layout['last_from']} to {shards} shards, done "
                f"{_when(layout['ended_ms'], now_ms)} ({plural(layout['moved'], 'key')} "
                "moved)"]
    return []


def _leader_text(shard: dict[str, Any]) -> str:
    if not shard["leader"]:
        return "(none)"
    return f"{shard['leader']} ({LAPSED})" if shard.get("lease_lapsed") else shard["leader"]


def _dead_lines(status: dict[str, Any], hints: CommandHints) -> list[str]:
    """The oldest dead letters, headed by their count and the commands that list and
    re-queue them."""
    if not status["dead_letters"]:
        return []
    total = sum(r["dead"] for r in status["rules"].values())
    shown = len(status["dead_letters"])
    count = (f"{shown} of {total} shown; every one with {hints.command('dead list')}"
             if total > shown else plural(total, "dead letter"))
    lines = ["", f"DEAD LETTERS ({count}; re-queue with {hints.command('dead retry', 'KEY')} "
                 f"or `--all`{hints.note})"]
    for d in status["dead_letters"]:
        after = plural(d["attempts"], "attempt") if d["attempts"] is not None else "?"
        lines.append(f"  {d['key']}  [{d['rule']}] after {after}: {d['error']}")
    return lines


def _recent_lines(status: dict[str, Any]) -> list[str]:
    """Failures among each rule's recent refreshes (from the shards' histories)."""
    lines = ["", f"RECENT REFRESHES (newest {recent_per_shard(len(status['shards']))} per shard)"]
    for name, r in status["rules"].items():
        recent = r.get("recent") or {"refreshes": 0, "failed": 0}
        lines.append(f"  {name:<24} failures {recent['failed']} of last {recent['refreshes']}")
    return lines
