"""The ``sources:`` block of a rules file: Redis Streams whose entries are touches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from yaml.nodes import Node, SequenceNode

from coalescer.config.patterns import KeyPattern
from coalescer.config.templates import KeyTemplate
from coalescer.errors import ConfigError

SOURCE_FIELDS = ("name", "stream", "group", "start", "key")
STARTS = ("new", "all")
DEFAULT_GROUP = "coalescer"


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """One stream source: each entry of ``stream`` touches ``key`` filled from its fields."""

    name: str
    stream: str
    group: str = DEFAULT_GROUP
    start: str = "new"  # "new": entries added after the group was created; "all": from 0
    key: KeyTemplate
    line: int

    @property
    def start_id(self) -> str:
        """The ID a group created for this source starts after."""
        return "$" if self.start == "new" else "0"


class _Loader(Protocol):
    """What of the rules loader the sources need (see rules._Loader)."""

    def mapping(self, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> dict[str, tuple[Node, Node]]: ...
    def require(self, entries: dict[str, tuple[Node, Node]], name: str, node: Node,
                prefix: str, what: str) -> Node: ...
    def string(self, node: Node, field: str, what: str) -> str: ...
    def identifier(self, node: Node, field: str, what: str) -> str: ...
    def value(self, node: Node, field: str) -> Any: ...
    def error(self, message: str, node: Node, field: str | None) -> ConfigError: ...


def load_sources(loader: _Loader, node: Node,
                 patterns: Sequence[KeyPattern]) -> tuple[Source, ...]:
    """Every source of the ``sources:`` list, checked against the rules' patterns."""
    if not isinstance(node, SequenceNode):
        if loader.value(node, "sources") is None:
            return ()
        raise loader.error("sources must be a list of sources (name, stream, key, ...)",
                           node, "sources")
    seen: dict[str, int] = {}
    return tuple(_source(loader, item, f"sources[{index}]", patterns, seen)
                 for index, item in enumerate(node.value))


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


def _source(loader: _Loader, node: Node, prefix: str, patterns: Sequence[KeyPattern],
            seen: dict[str, int]) -> Source:
    entries = loader.mapping(node, prefix, SOURCE_FIELDS, "a source")
    name_node = loader.require(entries, "name", node, prefix, "the source")
    name = loader.identifier(name_node, f"{prefix}.name", "source name")
    if name in seen:
        raise loader.error(f"duplicate source name {name!r} (first used on line "
                           f"{seen[name]}); source names must be unique", name_node,
                           f"{prefix}.name")
    seen[name] = _line(name_node)
    stream = loader.string(loader.require(entries, "stream", node, prefix, "the source"),
                           f"{prefix}.stream", "stream")
    group = DEFAULT_GROUP
    if "group" in entries:
        group = loader.string(entries["group"][1], f"{prefix}.group", "group")
    start = "new"
    if "start" in entries:
        start = _start(loader, entries["start"][1], f"{prefix}.start")
    key_node = loader.require(entries, "key", node, prefix, "the source")
    key = _template(loader, key_node, f"{prefix}.key", patterns)
    return Source(name=name, stream=stream, group=group, start=start, key=key,
                  line=_line(node))


def _start(loader: _Loader, node: Node, field: str) -> str:
    raw = loader.value(node, field)
    if raw not in STARTS:
        raise loader.error(f"start must be 'new' (only entries added from now on) or 'all' "
                           f"(every entry in the stream), got {raw!r}", node, field)
    return str(raw)


def _template(loader: _Loader, node: Node, field: str,
              patterns: Sequence[KeyPattern]) -> KeyTemplate:
    source = loader.string(node, field, "key")
    try:
        template = KeyTemplate.compile(source)
    except ValueError as exc:
        raise loader.error(str(exc), node, field) from None
    if not any(template.could_match(pattern) for pattern in patterns):
        shown = ", ".join(repr(p.source) for p in patterns[:5])
        shown += ", ..." if len(patterns) > 5 else ""
        raise loader.error(f"key template {source!r} can never match a rule, whatever the "
                           f"entry's fields hold (the rules match {shown}); every entry "
                           "would be rejected", node, field)
    return template
