"""A rule's ``fair:`` and ``priority:`` fields: fair order between the values of one
capture (the tenants) inside a rule, and a time offset that orders due keys.

``fair: {by: "{org}", weights: {acme: 3}, max_running: 4}`` makes each value of the
capture ``org`` a group; the claim script (``store/lua/_fair.lua``) hands out claims
in start-time fair order between the groups that have due keys, each group's share of
the claims in proportion to its weight (1 unless named), and at most ``max_running``
runs of one group in flight. ``priority: 5s`` makes the rule's keys claimed, among due
keys, as if due 5 s earlier (never before their own due time). docs/concepts.md
explains the order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from yaml.nodes import Node

from coalescer.config.durations import format_duration
from coalescer.config.matcher import ANYTHING, CAPTURE, LITERAL
from coalescer.config.patterns import KeyPattern
from coalescer.config.yaml_reader import YamlReader, join, kind, shown

FAIR_FIELDS = ("by", "weights", "max_running")
MAX_WEIGHT = 1_000_000.0
MAX_RUNNING = 1_000_000
MAX_WEIGHTS = 10_000  # named weights in one rule
MAX_PRIORITY = 86_400.0 * 366  # seconds: a year and a day
_LUA_MAGIC = set("^$()%.[]*+-?")


@dataclass(frozen=True, kw_only=True, slots=True)
class FairPolicy:
    """A rule's ``fair:``: the capture whose values are the groups, each group's
    weight (``weights``; 1 for a value not named) and the cap on one group's runs in
    flight, cluster-wide (None: no cap). ``lua_pattern`` is the rule's pattern as a
    Lua pattern whose one capture is the group (the claim script reads it)."""

    by: str
    weights: Mapping[str, float] = field(default_factory=dict, hash=False)  # a Rule is hashed
    max_running: int | None = None
    lua_pattern: str = ""

    def weight(self, group: str) -> float:
        return self.weights.get(group, 1.0)

    def describe(self) -> str:
        parts = [f"fair: by {{{self.by}}} (start-time fair order between its values)"]
        if self.weights:
            named = ", ".join(f"{v}={_num(w)}" for v, w in sorted(self.weights.items()))
            parts.append(f"weights {named} (others 1)")
        if self.max_running is not None:
            parts.append(f"max_running {self.max_running} per group, cluster-wide")
        return "; ".join(parts)


def fair_lines(fair: FairPolicy | None, priority: float | None) -> list[str]:
    """The lines ``check -v`` shows for a rule's ``fair`` and ``priority``."""
    lines = [] if fair is None else ["  " + fair.describe()]
    if priority is not None:
        lines.append(f"  priority: {format_duration(priority)} (claimed among due keys as "
                     "if due that much earlier)")
    return lines


def _num(weight: float) -> str:
    return str(int(weight)) if weight == int(weight) else repr(weight)


def lua_pattern(pattern: KeyPattern, by: str) -> str:
    """``pattern`` as an anchored Lua pattern capturing only the segment ``by``."""
    out, names = ["^"], iter(pattern.names)
    for token in pattern.matcher.tokens:
        if token.kind == LITERAL:
            out.append("".join(f"%{c}" if c in _LUA_MAGIC else c for c in token.text))
        elif token.kind == CAPTURE:
            out.append("([^:]+)" if next(names) == by else "[^:]+")
        elif token.kind == ANYTHING:
            out.append(".*")
    out.append("$")
    return "".join(out)


class FairReader:
    """Reads ``fair:`` and ``priority:`` with a rules file's reader (its errors carry
    the file, line and field)."""

    def __init__(self, reader: YamlReader) -> None:
        self.r = reader

    def fair(self, node: Node, prefix: str, pattern: KeyPattern | None) -> FairPolicy:
        r = self.r
        entries = r.mapping(node, prefix, FAIR_FIELDS, "fair")
        by_node = r.require(entries, "by", node, prefix, "fair")
        by = self.by(by_node, join(prefix, "by"), pattern)
        no_weights: dict[str, float] = {}
        weights = r.optional(entries, prefix, "weights", self.weights, no_weights)
        cap = r.optional(entries, prefix, "max_running", self.max_running, None)
        lua = lua_pattern(pattern, by) if pattern is not None else ""
        return FairPolicy(by=by, weights=weights, max_running=cap, lua_pattern=lua)

    def by(self, node: Node, field: str, pattern: KeyPattern | None) -> str:
        raw = self.r.string(node, field, "fair.by")
        name = raw[1:-1] if raw.startswith("{") and raw.endswith("}") else raw
        if pattern is None:
            return name
        if name not in pattern.names:
            known = ", ".join(f"{{{n}}}" for n in pattern.names) or "none"
            raise self.r.error(f"fair.by names {shown(raw)}, which is not a capture of the "
                               f"rule's pattern {pattern.source!r} (its captures: {known})",
                               node, field)
        stars = sum(t.kind == ANYTHING for t in pattern.matcher.tokens)
        if stars > 1:
            raise self.r.error(f"a fair rule's pattern may hold at most one '*' (the claim "
                               f"script reads the group from each key), got "
                               f"{pattern.source!r}", node, field)
        return name

    def max_running(self, node: Node, field: str) -> int | None:
        return self.r.positive_int(node, field, MAX_RUNNING)

    def weights(self, node: Node, field: str) -> dict[str, float]:
        raw = self.r.value(node, field)
        if not isinstance(raw, dict):
            raise self.r.error(f"fair.weights must be a mapping of a capture's value to a "
                               f"weight (acme: 3), got {kind(raw)}", node, field)
        if len(raw) > MAX_WEIGHTS:
            raise self.r.error(f"fair.weights may name at most {MAX_WEIGHTS} values, got "
                               f"{len(raw)}", node, field)
        out: dict[str, float] = {}
        for value, weight in raw.items():
            out[str(value)] = check_weight(weight, self._blame(node, join(field, str(value))))
        return out

    def _blame(self, node: Node, field: str) -> Callable[[str], Exception]:
        def error(message: str) -> Exception:
            return self.r.error(message, node, field)
        return error

    def priority(self, node: Node, field: str) -> float:
        seconds = self.r.duration(node, field, positive=False)
        if seconds > MAX_PRIORITY:
            raise self.r.error(f"priority must be at most a year and a day, got "
                               f"{shown(self.r.value(node, field))}", node, field)
        return seconds


def check_weight(weight: object, error: Callable[[str], Exception]) -> float:
    """A weight: a number above 0 and at most MAX_WEIGHT; else raises ``error(message)``."""
    if (isinstance(weight, bool) or not isinstance(weight, int | float)
            or not math.isfinite(weight) or not 0 < weight <= MAX_WEIGHT):
        raise error(f"a weight must be a number above 0 and at most {int(MAX_WEIGHT)}, "
                    f"got {shown(weight)}")
    return float(weight)
