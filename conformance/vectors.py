"""The cases of each level, read from vectors/levelN.json (README.md: Vectors)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from conformance.servers import KINDS

VECTORS = Path(__file__).parent / "vectors"
LEVELS = (0, 1, 2)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One scenario: its servers, its rules, its steps."""

    level: int
    name: str
    servers: str
    slow: bool
    rules: str
    steps: tuple[dict[str, Any], ...]

    @property
    def id(self) -> str:
        return f"level{self.level}: {self.name}"


def load(levels: tuple[int, ...] = LEVELS) -> list[Case]:
    """Every case of ``levels``, in file order. ValueError names a malformed one."""
    cases: list[Case] = []
    for level in levels:
        path = VECTORS / f"level{level}.json"
        document = json.loads(path.read_text(encoding="utf-8"))
        if document.get("level") != level:
            raise ValueError(f"{path}: level is {document.get('level')!r}, not {level}")
        for n, raw in enumerate(document["cases"]):
            cases.append(_case(level, raw, f"{path.name}: cases[{n}]"))
    names = [c.id for c in cases]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ValueError(f"cases named twice: {doubled}")
    return cases


def _case(level: int, raw: dict[str, Any], where: str) -> Case:
    servers = raw.get("servers", "single")
    if servers not in KINDS:
        raise ValueError(f"{where}: servers is {servers!r}, one of {KINDS}")
    steps = raw.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"{where}: steps must be a non-empty list")
    if not isinstance(raw.get("name"), str) or not isinstance(raw.get("rules"), str):
        raise ValueError(f"{where}: name and rules must be text")
    return Case(level=level, name=raw["name"], servers=servers, slow=bool(raw.get("slow")),
                rules=raw["rules"], steps=tuple(steps))


def resolve_times(value: Any, marks: dict[str, int]) -> Any:
    """``value`` with every ``{"$time": MARK, "plus_ms": N, "form": "ms"|"iso"}`` replaced
    by that server time (epoch ms, or ISO-8601 text with an offset), nested too."""
    if isinstance(value, list):
        return [resolve_times(v, marks) for v in value]
    if not isinstance(value, dict):
        return value
    if "$time" in value:
        ms = marks[value["$time"]] + int(value.get("plus_ms", 0))
        if value.get("form", "ms") == "iso":
            return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
        return ms
    return {k: resolve_times(v, marks) for k, v in value.items()}
