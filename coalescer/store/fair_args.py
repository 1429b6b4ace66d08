"""What the claim script needs to know of a call's fair rules (``store/lua/_fair.lua``):
each rule's group pattern, cap, weights and priority, and where its order lives.

Rules without ``fair:`` add nothing to a claim call: the script's plain path and cost
are those of a rule that never heard of fairness."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coalescer.config.model import Rule
from coalescer.store.keys import ShardKeys, fair_runs

FAIR_TAG = "\0FAIR"


@dataclass(frozen=True, slots=True)
class FairSpec:
    """One fair rule as the claim script reads it (weights and cap as the rules file
    says; the script applies the runtime ones over them)."""

    pattern: str
    cap: int  # 0: none
    weights: str  # "VALUE\0W\0VALUE\0W..." or ""
    priority_ms: int


NO_FAIR: Mapping[str, FairSpec] = {}


def fair_rules(rules: Iterable[Rule]) -> dict[str, FairSpec]:
    """The rules with ``fair:`` or a ``priority:`` (which orders due keys the same way: a
    rule with a priority and no ``fair`` is one group, its pattern "")."""
    out = {}
    for rule in rules:
        fair, priority_ms = rule.fair, round((rule.priority or 0) * 1000)
        if fair is None:
            if rule.priority is not None:
                out[rule.name] = FairSpec("", 0, "", priority_ms)
            continue
        weights = "\0".join(f"{value}\0{weight!r}" for value, weight in fair.weights.items())
        out[rule.name] = FairSpec(fair.lua_pattern, fair.max_running or 0, weights,
                                  priority_ms)
    return out


def fair_section(shard: ShardKeys, fair: Mapping[str, FairSpec], rules: Sequence[str],
                 *, cluster: bool) -> list[Any]:
    """The fair section of a claim call's arguments (empty when no rule of the call is
    fair). On one server a group's runs in flight are counted in one place for every
    shard (its cap holds cluster-wide); on a Redis Cluster, in each shard's slot."""
    if not fair or not any(rule in fair for rule in rules):
        return []
    args: list[Any] = [FAIR_TAG, sum(rule in fair for rule in rules)]
    for index, rule in enumerate(rules):
        spec = fair.get(rule)
        if spec is None:
            continue
        prefix = shard.fair(rule)
        runs = prefix + "run:" if cluster else fair_runs(shard.namespace, rule)
        args += [index, spec.pattern, prefix, runs, prefix + "conf", spec.cap, spec.weights,
                 spec.priority_ms]
    return args
