"""Fair rules as `coalescer status`, `explain`, the page and the metrics show them: each
group's backlog, its share of the claims, its weight, and the cap with its runs in flight
(what each figure means, and the bounds: docs/operations.md, "Fair groups in status, the
page and metrics"). Read from the claim script's order (``store/lua/_fair.lua``), over
every shard: at most ``GROUPS_READ`` groups and ``GROUPS_READ`` keys in flight of each
shard (``partial`` says when some were left out), keeping the ``TOP`` groups by backlog
(then runs) and the rest summed into ``other``. One read of each rule's settings, then
two pipelined round trips.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.config.rules import Config, Rule
from coalescer.query.fair_controls import FairView, fair_view
from coalescer.store.keys import KeySpace

TOP = 10  # groups shown (and exported as metric series) per rule; the rest summed
GROUPS_READ = 1000  # groups read per shard at most
OTHER = "(other)"  # the group label of the rest


@dataclass
class _Groups:
    """What one fair rule's reads found: backlog and runs per group, settings."""

    backlog: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    running: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    weights: dict[str, float] = field(default_factory=dict)
    cap: int | None = None
    partial: bool = False


def fair_rules(config: Config) -> list[Rule]:
    return [r for r in config.rules if r.fair is not None]


async def read_fair(redis: Any, config: Config, rules: list[Rule], space: KeySpace,
                    focus: str | None = None) -> dict[str, dict[str, Any]]:
    """Per fair rule in ``rules``: its groups' figures (see ``summary``); with ``focus``,
    that group's figures too (``focus``), read even when it is not among those read."""
    if not rules:
        return {}
    found, listed = await _groups(redis, config, rules, space, focus)
    await _counts(redis, found, listed)
    out = {r.name: summary(found[r.name], r) for r in rules}
    if focus is not None:
        for r in rules:
            out[r.name]["focus"] = _entry(found[r.name], focus, out[r.name]["total_weight"])
    return out


async def _groups(redis: Any, config: Config, rules: list[Rule], space: KeySpace,
                  focus: str | None) -> tuple[dict[str, _Groups], list[tuple[str, str, str]]]:
    """The first round trip: each rule's settings and, per shard, its groups with due
    keys in fair order, then those whose keys are not due yet (at most ``GROUPS_READ``
    of each); the (rule, shard prefix, group) to count."""
    found = {r.name: _Groups() for r in rules}
    for rule in rules:
        _settings(found[rule.name], await fair_view(redis, config, rule.name))
    pipe = redis.pipeline(transaction=False)
    for rule in rules:
        for sk in space.all_shards():
            prefix = sk.fair(rule.name)
            for order in ("groups", "heads"):
                pipe.zcard(prefix + order)
                pipe.zrange(prefix + order, 0, GROUPS_READ - 1)
            pipe.zcard(sk.inflight(rule.name))
            pipe.zrange(sk.inflight(rule.name), 0, GROUPS_READ - 1)
    replies = iter(await pipe.execute())
    listed: list[tuple[str, str, str]] = []
    for rule in rules:
        for sk in space.all_shards():
            total, groups = int(next(replies)), [str(g) for g in next(replies)]
            later, more = int(next(replies)), [str(g) for g in next(replies)]
            flying, keys = int(next(replies)), [str(k) for k in next(replies)]
            found[rule.name].partial |= (total > len(groups) or later > len(more)
                                         or flying > len(keys))
            groups = list(dict.fromkeys(groups + more))
            _running(found[rule.name], rule, keys)
            prefix = sk.fair(rule.name)
            listed += [(rule.name, prefix, g) for g in groups if g != focus]
            if focus is not None:
                listed.append((rule.name, prefix, focus))
    return found, listed


def _settings(g: _Groups, view: FairView) -> None:
    g.weights = dict(view.weights)
    g.cap = view.max_running


def _running(g: _Groups, rule: Rule, keys: list[str]) -> None:
    for key in keys:
        group = group_of(rule, key)
        if group is not None:
            g.running[group] += 1


async def _counts(redis: Any, found: dict[str, _Groups],
                  listed: list[tuple[str, str, str]]) -> None:
    """Each listed group's backlog in each shard: its keys due by the server's time."""
    if not listed:
        return
    sec, usec = await redis.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    pipe = redis.pipeline(transaction=False)
    for _, prefix, group in listed:
        pipe.zcount(prefix + "q:" + group, "-inf", now_ms)
    for (rule, _, group), count in zip(listed, await pipe.execute(), strict=True):
        found[rule].backlog[group] += int(count)


def summary(g: _Groups, rule: Rule) -> dict[str, Any]:
    """The ``TOP`` groups by backlog and the rest summed, each with its share."""
    assert rule.fair is not None
    waiting = {k: v for k, v in g.backlog.items() if v > 0}
    total_w = sum(g.weights.get(k, 1.0) for k in waiting) or 1.0
    active = set(waiting) | {k for k, v in g.running.items() if v > 0}
    ranked = sorted(active, key=lambda k: (-waiting.get(k, 0), -g.running.get(k, 0), k))
    rest = ranked[TOP:]
    other = None
    if rest:
        other = {"group": OTHER, "groups": len(rest),
                 "backlog": sum(waiting.get(k, 0) for k in rest),
                 "weight": sum(g.weights.get(k, 1.0) for k in rest),
                 "share": sum(g.weights.get(k, 1.0) for k in rest if k in waiting) / total_w,
                 "running": sum(g.running.get(k, 0) for k in rest)}
    return {"by": rule.fair.by, "cap": g.cap, "weights": g.weights,
            "groups": len(active), "waiting": len(waiting),
            "backlog": sum(waiting.values()), "total_weight": total_w,
            "top": [_entry(g, k, total_w) for k in ranked[:TOP]], "other": other,
            "partial": g.partial}


def _entry(g: _Groups, group: str, total_w: float) -> dict[str, Any]:
    """One group's figures; its share is of the claims while the groups read stay
    backlogged (0 while it has no due key waiting)."""
    weight = g.weights.get(group, 1.0)
    backlog = g.backlog.get(group, 0)
    return {"group": group, "backlog": backlog, "weight": weight,
            "share": weight / total_w if backlog else 0.0,
            "running": g.running.get(group, 0)}


async def add_fair(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend each fair rule of ``status["rules"]`` with ``fair`` (see ``summary``)."""
    rules = fair_rules(config)
    if not rules:
        return
    space = KeySpace(config.namespace, len(status["shards"]))  # every shard status read
    for name, entry in (await read_fair(redis, config, rules, space)).items():
        status["rules"].setdefault(name, {})["fair"] = entry


def group_of(rule: Rule, key: str) -> str | None:
    """The group (the ``fair.by`` capture's value) ``key`` belongs to in ``rule``."""
    if rule.fair is None:
        return None
    params = rule.pattern.match(key)
    return None if params is None else params.get(rule.fair.by)


async def explain_fair(redis: Any, config: Config, rule: Rule, key: str,
                       space: KeySpace) -> dict[str, Any] | None:
    """For ``explain``: the group of ``key`` in its fair rule, and how it stands
    (None for a rule without ``fair``)."""
    group = group_of(rule, key)
    if group is None:
        return None
    fair = (await read_fair(redis, config, [rule], space, focus=group))[rule.name]
    return {"by": fair["by"], "cap": fair["cap"], "groups": fair["groups"],
            "waiting": fair["waiting"], "partial": fair["partial"], "group": fair["focus"]}


# -- lines -------------------------------------------------------------------------------


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def _num(v: float) -> str:
    return str(int(v)) if v == int(v) else f"{v:g}"


def _cap_text(cap: int | None) -> str:
    return "no cap" if cap is None else f"max_running {cap} a group"


def _group_row(e: dict[str, Any], cap: int | None) -> str:
    running = str(e["running"]) if cap is None else f"{e['running']}/{cap}"
    label = e["group"] if e["group"] != OTHER else f"{OTHER} {plural(e['groups'], 'group')}"
    return (f"    {label:<28} {e['backlog']:>9} {_pct(e['share']):>6} "
            f"{_num(e['weight']):>7} {running:>8}")


def format_fair(status: dict[str, Any]) -> list[str]:
    """A FAIR section: per fair rule a header, then its top groups and the rest."""
    rules = {n: r["fair"] for n, r in status["rules"].items() if r.get("fair")}
    if not rules:
        return []
    lines = ["", "FAIR (per group: due keys waiting, share of the claims, runs in flight)"]
    for name, f in rules.items():
        more = " (at least: not every group read)" if f["partial"] else ""
        lines.append(f"  {name}: by {{{f['by']}}}, {plural(f['waiting'], 'group')} with "
                     f"{plural(f['backlog'], 'key')} waiting{more}; {_cap_text(f['cap'])}")
        if not f["top"]:
            continue
        lines.append(f"    {'GROUP':<28} {'BACKLOG':>9} {'SHARE':>6} {'WEIGHT':>7} "
                     f"{'RUNNING':>8}")
        rows = [*f["top"], *([f["other"]] if f["other"] else [])]
        lines += [_group_row(e, f["cap"]) for e in rows]
    return lines


def explain_fair_lines(fair: dict[str, Any] | None) -> list[str]:
    """The lines of `explain` for a key of a fair rule: its group and how it stands."""
    if not fair:
        return []
    g, cap = fair["group"], fair["cap"]
    running = f"{g['running']} running" + ("" if cap is None else f" of {cap}")
    return [f"fair group: {{{fair['by']}}} = {g['group']}: "
            f"{plural(g['backlog'], 'due key')} waiting, {running}, weight "
            f"{_num(g['weight'])}, share {_pct(g['share'])} of the claims "
            f"({_cap_text(cap)}; {plural(fair['waiting'], 'group')} with keys waiting)"]


def fair_gauges(metrics: Metrics, status: dict[str, Any]) -> None:
    """Set the per-group gauges from a status: the series of the groups shown now only
    (the top ones and "(other)"), so their number stays bounded however the top moves."""
    gauges = (metrics.fair_backlog, metrics.fair_share, metrics.fair_running)
    for gauge in gauges:
        gauge.clear()
    for name, entry in status.get("rules", {}).items():
        fair = entry.get("fair")
        if not fair:
            continue
        for e in [*fair["top"], *([fair["other"]] if fair["other"] else [])]:
            metrics.fair_backlog.labels(name, e["group"]).set(e["backlog"])
            metrics.fair_share.labels(name, e["group"]).set(e["share"])
            metrics.fair_running.labels(name, e["group"]).set(e["running"])
