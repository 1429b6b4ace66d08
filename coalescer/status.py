"""What `coalescer status`, GET /status and the gauges report, read from Redis."""

from __future__ import annotations

from typing import Any

from .history import RECENT, recent_by_rule
from .keys import KeySpace
from .registry_status import add_registry, format_registry
from .rules import Config

DEAD_LISTED = 20


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


async def gather_status(redis: Any, config: Config) -> dict[str, Any]:
    """Leader per shard, pending / in-flight / dead per rule, next due, dead letters."""
    space = KeySpace(config.namespace, config.shards)
    rules: dict[str, dict[str, Any]] = {
        r.name: {"pending": 0, "in_flight": 0, "dead": 0, "next_due_ms": None}
        for r in config.rules}
    shards, dead = [], []
    for sk in space.all_shards():
        leader = await redis.get(sk.leader)
        shards.append({"shard": sk.shard, "leader": _leader_node(leader),
                       "epoch": int(leader.split("|", 1)[0]) if leader else None})
        for rule in config.rules:
            entry = rules[rule.name]
            entry["pending"] += await redis.zcard(sk.due(rule.name))
            entry["in_flight"] += await redis.zcard(sk.inflight(rule.name))
            entry["dead"] += await redis.zcard(sk.dead(rule.name))
            head = await redis.zrange(sk.due(rule.name), 0, 0, withscores=True)
            if head and (entry["next_due_ms"] is None or head[0][1] < entry["next_due_ms"]):
                entry["next_due_ms"] = int(head[0][1])
            for key, since in await redis.zrange(sk.dead(rule.name), 0, DEAD_LISTED - 1,
                                                 withscores=True):
                dead.append(_dead_entry(key, rule.name, since, await redis.hget(sk.meta, key)))
    for name, recent in (await recent_by_rule(redis, config)).items():
        rules[name]["recent"] = recent
    status = {"namespace": config.namespace, "shards": shards, "rules": rules,
              "dead_letters": dead[:DEAD_LISTED]}
    await add_registry(redis, config, status)
    return status


def _when(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return "-"
    delta = (ms - now_ms) / 1000
    return f"in {delta:.1f}s" if delta >= 0 else f"{-delta:.1f}s ago"


def format_status(status: dict[str, Any], now_ms: int) -> str:
    """A readable table of a status dict."""
    lines = [f"namespace {status['namespace']}", "", "SHARD  LEADER"]
    for s in status["shards"]:
        lines.append(f"{s['shard']:<6} {s['leader'] or '(none)'}")
    lines += ["", f"{'RULE':<24} {'PENDING':>8} {'IN-FLIGHT':>10} {'DEAD':>6}  NEXT DUE"]
    for name, r in status["rules"].items():
        lines.append(f"{name:<24} {r['pending']:>8} {r['in_flight']:>10} {r['dead']:>6}  "
                     f"{_when(r['next_due_ms'], now_ms)}")
    lines += format_registry(status)
    lines += _recent_lines(status)
    if status["dead_letters"]:
        lines += ["", "DEAD LETTERS (re-queue with `coalescer retry KEY` or `--all`)"]
        for d in status["dead_letters"]:
            lines.append(f"  {d['key']}  [{d['rule']}] after {d['attempts']} attempts: "
                         f"{d['error']}")
    return "\n".join(lines)


def _recent_lines(status: dict[str, Any]) -> list[str]:
    """Failures among each rule's recent refreshes (from the shards' histories)."""
    lines = ["", f"RECENT REFRESHES (newest {RECENT} per shard)"]
    for name, r in status["rules"].items():
        recent = r.get("recent") or {"refreshes": 0, "failed": 0}
        lines.append(f"  {name:<24} failures {recent['failed']} of last {recent['refreshes']}")
    return lines
