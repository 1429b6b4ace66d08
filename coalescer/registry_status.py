"""The rules registry in `coalescer status`: each live node's rules, mismatches, unserved rules.

Adds to the status dict:

- ``nodes``: ``[{"node", "last_seen_ms", "rules": {NAME: FINGERPRINT}}]``, the live
  worker nodes (heard from within two leader leases);
- ``rules_mismatch``: ``{"missing": {RULE: [nodes lacking it]}, "differing":
  {RULE: {NODE: FINGERPRINT}}}``, both empty when every live node runs the same rules;
- per rule: ``known_by`` (the live nodes that serve it) and ``unserved`` (true while
  it has pending keys and no live node knows it), ``in_rules_file`` (false for a
  rule some node registered that the reader's rules file lacks: listed too).
"""

from __future__ import annotations

from typing import Any

from .keys import KeySpace, ShardKeys
from .registry import compare, decode
from .rules import Config
from .scripts import Peer, Scripts


async def add_registry(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend ``status`` (from gather_status) with the registry's view."""
    space = KeySpace(config.namespace, config.shards)
    scripts = Scripts(redis)
    live_ms = round(2 * config.leader_lease * 1000)
    nodes: dict[str, Peer] = {}
    names: set[str] = set()
    for sk in space.all_shards():
        _, peers = await scripts.peers(sk, live_ms)
        for peer in peers:
            seen = nodes.get(peer.node)
            if seen is None or (peer.rules and not seen.rules):
                nodes[peer.node] = peer
        names |= set(await redis.smembers(sk.rule_names))
    known = {node: decode(p.rules) for node, p in sorted(nodes.items())}
    status["nodes"] = [{"node": node, "last_seen_ms": nodes[node].last_seen_ms, "rules": rules}
                       for node, rules in known.items()]
    mismatch = compare(known)
    status["rules_mismatch"] = {"missing": mismatch.missing, "differing": mismatch.differing}
    rules = status["rules"]
    for name in sorted(names - rules.keys()):
        rules[name] = await _counts(redis, space.all_shards(), name)
    for name, entry in rules.items():
        entry.setdefault("in_rules_file", True)
        entry["known_by"] = [node for node, r in known.items() if name in r]
        entry["unserved"] = entry["pending"] > 0 and not entry["known_by"]


async def _counts(redis: Any, shards: list[ShardKeys], name: str) -> dict[str, Any]:
    """Pending, in-flight and dead counts and next due of a rule this rules file lacks."""
    entry: dict[str, Any] = {"pending": 0, "in_flight": 0, "dead": 0, "next_due_ms": None,
                             "in_rules_file": False}
    for sk in shards:
        entry["pending"] += await redis.zcard(sk.due(name))
        entry["in_flight"] += await redis.zcard(sk.inflight(name))
        entry["dead"] += await redis.zcard(sk.dead(name))
        head = await redis.zrange(sk.due(name), 0, 0, withscores=True)
        if head and (entry["next_due_ms"] is None or head[0][1] < entry["next_due_ms"]):
            entry["next_due_ms"] = int(head[0][1])
    return entry


def format_registry(status: dict[str, Any]) -> list[str]:
    """The NODES section of the status table, and any mismatch."""
    nodes = status.get("nodes")
    if nodes is None:
        return []
    lines = ["", "NODE" + " " * 28 + "RULES"]
    for n in nodes:
        rules = ", ".join(n["rules"]) or "(none registered)"
        lines.append(f"{n['node']:<31} {rules}")
    mismatch = status.get("rules_mismatch") or {}
    for name, lacking in mismatch.get("missing", {}).items():
        lines.append(f"MISMATCH rule {name}: missing on {', '.join(lacking)}")
    for name, fps in mismatch.get("differing", {}).items():
        shown = ", ".join(f"{node} {fp}" for node, fp in fps.items())
        lines.append(f"MISMATCH rule {name}: settings differ ({shown})")
    for name, r in status["rules"].items():
        if r.get("unserved"):
            lines.append(f"UNSERVED rule {name}: {r['pending']} pending keys, and no live "
                         f"node knows the rule")
    return lines
