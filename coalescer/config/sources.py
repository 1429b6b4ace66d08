"""The ``sources:`` block of a rules file: where touches come from besides ``touch()``.

Each source has a ``name``, a ``type`` (``stream`` when not given) and the fields of its
type. A type's fields are read by the reader registered for it in ``SOURCE_TYPES``;
an unknown ``type`` is refused with the file, line and field and the known types. The
only type so far is ``stream``: a Redis Stream whose entries are touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from yaml.nodes import Node, SequenceNode

from coalescer.config.patterns import KeyPattern
from coalescer.config.templates import KeyTemplate
from coalescer.config.yaml_reader import Entries, YamlReader, line_of, shown

COMMON_FIELDS = ("name", "type")
STREAM_FIELDS = ("stream", "group", "start", "key", "item")
STARTS = ("new", "all")
DEFAULT_GROUP = "coalescer"
DEFAULT_TYPE = "stream"


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """What every source has: its name and the line it starts on; ``type`` names its
    type (the ``type:`` field)."""

    type: ClassVar[str] = ""
    name: str
    line: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamSource(SourceConfig):
    """One stream source: each entry of ``stream`` touches ``key`` filled from its fields."""

    type: ClassVar[str] = "stream"
    stream: str
    group: str = DEFAULT_GROUP
    start: str = "new"  # "new": entries added after the group was created; "all": from 0
    key: KeyTemplate
    item: KeyTemplate | None = None  # filled like key: the item each entry's touch carries

    @property
    def start_id(self) -> str:
        """The ID a group created for this source starts after."""
        return "$" if self.start == "new" else "0"


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceItem:
    """One item of the ``sources:`` list as a type's reader gets it: its fields, its node,
    its field prefix (``sources[0]``), its name (checked already) and the rules'
    patterns, which a key it touches must be able to match."""

    entries: Entries
    node: Node
    prefix: str
    name: str
    patterns: Sequence[KeyPattern]
    item_patterns: Sequence[KeyPattern] = ()  # the patterns of the rules with items


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFields:
    """How the ``sources:`` block reads one type: the fields it allows (besides name and
    type) and the function that builds its config from them."""

    fields: tuple[str, ...]
    read: Callable[[YamlReader, SourceItem], SourceConfig]


def load_sources(reader: YamlReader, node: Node, patterns: Sequence[KeyPattern],
                 item_patterns: Sequence[KeyPattern] = ()) -> tuple[SourceConfig, ...]:
    """Every source of the ``sources:`` list, checked against the rules' patterns (and
    those of the rules with items, for a source whose entries carry an item)."""
    if not isinstance(node, SequenceNode):
        if reader.value(node, "sources") is None:
            return ()
        raise reader.error("sources must be a list of sources (name, stream, key, ...)",
                           node, "sources")
    seen: dict[str, int] = {}
    return tuple(_source(reader, item, f"sources[{index}]", (patterns, item_patterns), seen)
                 for index, item in enumerate(node.value))


def _source(reader: YamlReader, node: Node, prefix: str,
            patterns: tuple[Sequence[KeyPattern], Sequence[KeyPattern]],
            seen: dict[str, int]) -> SourceConfig:
    entries = reader.mapping(node, prefix, _every_field(), "a source")
    type_name = _type(reader, entries, prefix)
    name_node = reader.require(entries, "name", node, prefix, "the source")
    name = reader.identifier(name_node, f"{prefix}.name", "source name")
    if name in seen:
        raise reader.error(f"duplicate source name {name!r} (first used on line "
                           f"{seen[name]}); source names must be unique", name_node,
                           f"{prefix}.name")
    seen[name] = line_of(name_node)
    item = SourceItem(entries=entries, node=node, prefix=prefix, name=name,
                      patterns=patterns[0], item_patterns=patterns[1])
    return SOURCE_TYPES[type_name].read(reader, item)


def _type(reader: YamlReader, entries: Entries, prefix: str) -> str:
    """The source's ``type:``, refused unless a reader is registered for it, and
    refused if the source has a field of another type."""
    name = DEFAULT_TYPE
    if "type" in entries:
        node, field = entries["type"][1], f"{prefix}.type"
        raw = reader.value(node, field)
        if not isinstance(raw, str) or raw not in SOURCE_TYPES:
            raise reader.error(f"unknown source type {shown(raw)}; known types: "
                               f"{', '.join(SOURCE_TYPES)}", node, field)
        name = raw
    allowed = (*COMMON_FIELDS, *SOURCE_TYPES[name].fields)
    for field_name, (key_node, _) in entries.items():
        if field_name not in allowed:
            raise reader.error(f"field {field_name!r} is not a field of a {name} source; "
                               f"allowed: {', '.join(allowed)}", key_node,
                               f"{prefix}.{field_name}")
    return name


def _every_field() -> tuple[str, ...]:
    """The fields of every source type: name, each type's own fields, then type."""
    names = ["name"]
    for fields in SOURCE_TYPES.values():
        names += [name for name in fields.fields if name not in names]
    return (*names, "type")


def _stream(reader: YamlReader, item: SourceItem) -> StreamSource:
    entries, node, prefix = item.entries, item.node, item.prefix
    stream = reader.string(reader.require(entries, "stream", node, prefix, "the source"),
                           f"{prefix}.stream", "stream")
    group = DEFAULT_GROUP
    if "group" in entries:
        group = reader.string(entries["group"][1], f"{prefix}.group", "group")
    start = "new"
    if "start" in entries:
        start = _start(reader, entries["start"][1], f"{prefix}.start")
    key_node = reader.require(entries, "key", node, prefix, "the source")
    key = _template(reader, key_node, f"{prefix}.key", item.patterns)
    touched_item = None
    if "item" in entries:
        touched_item = _item_template(reader, entries["item"][1], f"{prefix}.item", key,
                                      item.item_patterns)
    return StreamSource(name=item.name, stream=stream, group=group, start=start, key=key,
                        item=touched_item, line=line_of(node))


def _item_template(reader: YamlReader, node: Node, field: str, key: KeyTemplate,
                   item_patterns: Sequence[KeyPattern]) -> KeyTemplate:
    """A source's ``item:``, a template filled from the entry's fields as ``key`` is;
    its keys must be able to match a rule with ``items:``."""
    source = reader.string(node, field, "item")
    try:
        template = KeyTemplate.compile(source)
    except ValueError as exc:
        raise reader.error(str(exc).replace("key template", "item template"), node,
                           field) from None
    if not any(key.could_match(pattern) for pattern in item_patterns):
        raise reader.error(f"the source's key template {key.source!r} can never match a rule "
                           "with items: {max: N}, so no entry's item could be delivered; "
                           "give the rule items:, or remove item:", node, field)
    return template


def _start(reader: YamlReader, node: Node, field: str) -> str:
    raw = reader.value(node, field)
    if raw not in STARTS:
        raise reader.error(f"start must be 'new' (only entries added from now on) or 'all' "
                           f"(every entry in the stream), got {raw!r}", node, field)
    return str(raw)


def _template(reader: YamlReader, node: Node, field: str,
              patterns: Sequence[KeyPattern]) -> KeyTemplate:
    source = reader.string(node, field, "key")
    try:
        template = KeyTemplate.compile(source)
    except ValueError as exc:
        raise reader.error(str(exc), node, field) from None
    if not any(template.could_match(pattern) for pattern in patterns):
        shown_patterns = ", ".join(repr(p.source) for p in patterns[:5])
        shown_patterns += ", ..." if len(patterns) > 5 else ""
        raise reader.error(f"key template {source!r} can never match a rule, whatever the "
                           f"entry's fields hold (the rules match {shown_patterns}); every "
                           "entry would be rejected", node, field)
    return template


SOURCE_TYPES: dict[str, SourceFields] = {
    "stream": SourceFields(fields=STREAM_FIELDS, read=_stream),
}
"""The source types a rules file may name, by their ``type:``; a new type adds its entry."""
