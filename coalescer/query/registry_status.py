"""The rules registry in `coalescer status`: each live node's rules, mismatches, unserved rules.

Adds to the status dict:

- ``nodes``: ``[{"node", "last_seen_ms", "rules": {NAME: FINGERPRINT}}]``, the live
  worker nodes (those whose node lease lives);
- per shard: ``lease_lapsed`` (true when its leader's node lease has ended: a standby
  is about to take it over);
- ``rules_mismatch``: ``{"missing": {RULE: [nodes lacking it]}, "differing":
  {RULE: {NODE: FINGERPRINT}}}``, both empty when every live node runs the same rules;
- per rule: ``known_by`` (the live nodes that serve it), ``no_worker`` (true when
  none does: nothing will refresh its keys) and ``unserved`` (true while it has
  pending keys and no live node knows it), ``in_rules_file`` (false for a rule some
  node registered that the reader's rules file lacks: listed too).
"""

from __future__ import annotations

from typing import Any

from coalescer.config.rules import Config
from coalescer.query.rule_counts import new_entry, queue_rule, read_rule
from coalescer.store.keys import KeySpace, ShardKeys, node_leases
from coalescer.store.script_types import Peer
from coalescer.worker.registry import compare, decode


async def add_registry(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend ``status`` (from gather_status) with the registry's view.

    Every worker registers in every shard, so shard 0's registry lists them all, and the
    node leases say which live (a node's last renewal is its ``last_seen_ms``): the server
    time, one pipelined read and the leases, plus one for the counts of rules this rules
    file lacks.
    """
    space = KeySpace(config.namespace, len(status["shards"]))  # every shard status read
    nodes, names, leased = await read_registry(redis, space.shard(0), config)
    for shard in status["shards"]:  # a leader whose node lease ended: a take-over is due
        shard["lease_lapsed"] = shard["leader"] is not None and shard["leader"] not in leased
    known = {p.node: decode(p.rules) for p in nodes}
    status["nodes"] = [{"node": p.node, "last_seen_ms": p.last_seen_ms, "rules": known[p.node]}
                       for p in nodes]
    mismatch = compare(known)
    status["rules_mismatch"] = {"missing": mismatch.missing, "differing": mismatch.differing}
    rules = status["rules"]
    foreign = sorted(names - rules.keys())
    if foreign:
        rules.update(await _counts(redis, space.all_shards(), foreign))
    for name, entry in rules.items():
        entry.setdefault("in_rules_file", True)
        entry["known_by"] = [node for node, r in known.items() if name in r]
        entry["no_worker"] = not entry["known_by"]
        entry["unserved"] = entry["pending"] > 0 and not entry["known_by"]


async def live_rules(redis: Any, sk: ShardKeys, config: Config) -> dict[str, set[str]]:
    """Each live worker node (its node lease lives, and shard ``sk``'s registry has
    its entry) -> the names of the rules it serves."""
    nodes, _, _ = await read_registry(redis, sk, config)
    return {p.node: set(decode(p.rules)) for p in nodes}


async def read_registry(redis: Any, sk: ShardKeys,
                        config: Config) -> tuple[list[Peer], set[str], set[str]]:
    """The live worker nodes of shard ``sk`` (sorted by id), every rule name registered,
    and every node whose node lease lives."""
    namespace, lease_ms = config.namespace, round(config.leader_lease * 1000)
    secs, micros = await redis.time()  # apart: a Cluster pipeline refuses TIME
    now_ms = int(secs) * 1000 + int(micros) // 1000
    pipe = redis.pipeline(transaction=False)
    pipe.zrange(sk.nodes, 0, -1)
    pipe.hgetall(sk.rules)
    pipe.smembers(sk.rule_names)
    pipe.zrangebyscore(node_leases(namespace), now_ms, "+inf", withscores=True)
    seen, entries, names, live = await pipe.execute()
    leases = dict(live)
    peers = [Peer(str(node), int(leases[node]) - lease_ms, str(entries.get(node, "")))
             for node in sorted(seen) if node in leases]
    return peers, {str(n) for n in names}, {str(n) for n in leases}


async def _counts(redis: Any, shards: list[ShardKeys],
                  names: list[str]) -> dict[str, dict[str, Any]]:
    """Pending, in-flight and dead counts and next due of rules this rules file lacks."""
    pipe = redis.pipeline(transaction=False)
    for sk in shards:
        for name in names:
            queue_rule(pipe, sk, name)
    replies = iter(await pipe.execute())
    out = {name: {**new_entry(), "in_rules_file": False} for name in names}
    for _ in shards:
        for name in names:
            read_rule(out[name], replies)
    return out


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
