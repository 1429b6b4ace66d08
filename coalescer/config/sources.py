"""The ``sources:`` block of a rules file: where touches come from besides ``touch()``.

Each source has a ``name``, a ``type`` (``stream`` when not given) and the fields of its
type. A type's fields are read by the reader registered for it in ``SOURCE_TYPES``;
an unknown ``type`` is refused with the file, line and field and the known types. Two
types: ``stream`` (a Redis Stream whose entries are touches) and ``outbox`` (rows of a
table in the application's database, written in its transactions).

Every type also takes ``at:`` or ``delay:`` (not both): a template filled from the
event's fields, as ``key:`` is, giving each touch a time of its own (read here for
every type, into ``SourceConfig``; ``sources/base.py`` fills it in).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, TypeVar

from yaml.nodes import Node, SequenceNode

from coalescer.common.redact import redact
from coalescer.config.durations import format_duration
from coalescer.config.lint import ConfigWarning
from coalescer.config.patterns import KeyPattern
from coalescer.config.schedule import schedule_spec
from coalescer.config.templates import KeyTemplate
from coalescer.config.yaml_reader import Entries, YamlReader, line_of, shown
from coalescer.errors import ConfigError, InvalidScheduleError

TIME_FIELDS = ("at", "delay")  # every type's: a touch's own time, from the event's fields
COMMON_FIELDS = ("name", "type", *TIME_FIELDS)
STREAM_FIELDS = ("stream", "group", "start", "key", "item")
STARTS = ("new", "all")
DEFAULT_GROUP = ""  # a source's group when none is given: derived from the namespace
OLD_DEFAULT_GROUP = "coalescer"  # the default group of earlier releases, for every namespace
DEFAULT_TYPE = "stream"
OUTBOX_FIELDS = ("url", "table", "batch", "poll")
DEFAULT_OUTBOX_TABLE = "coalescer_outbox"
DEFAULT_OUTBOX_BATCH = 1000  # rows claimed at a time
MAX_OUTBOX_BATCH = 10_000
DEFAULT_OUTBOX_POLL = 1.0  # seconds between two looks at an idle outbox, at most
MAX_OUTBOX_POLL = 60.0
OUTBOX_SCHEMES = {"postgresql": "postgresql", "postgres": "postgresql", "sqlite": "sqlite"}
_ENV_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """What every source has: its name and the line it starts on; ``type`` names its
    type (the ``type:`` field)."""

    type: ClassVar[str] = ""
    env_field: ClassVar[str | None] = None  # the field where ${NAME} may stand, if any
    name: str
    line: int
    # the time each event's touch carries, filled from its fields (at most one is set):
    # an absolute time (epoch seconds or ISO-8601 with an offset), or a delay
    at: KeyTemplate | None = None
    delay: KeyTemplate | None = None

    @property
    def time_fields(self) -> tuple[str, ...]:
        """The event fields the source's ``at:``/``delay:`` template reads."""
        template = self.at or self.delay
        return template.fields if template is not None else ()

    @property
    def env_names(self) -> list[str]:
        """The environment variables its ``env_field`` (a type's address, if it has one)
        refers to as ``${NAME}``, in order."""
        return [] if self.env_field is None else _ENV_REF.findall(getattr(self, self.env_field))

    def resolved(self, environ: Mapping[str, str]) -> str:
        """Its ``env_field`` with each ``${NAME}`` replaced by its value in ``environ``;
        KeyError naming the first one not set (or empty)."""
        def value(match: re.Match[str]) -> str:
            found = environ.get(match.group(1))
            if not found:
                raise KeyError(match.group(1))
            return found
        return _ENV_REF.sub(value, getattr(self, self.env_field or ""))


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
class OutboxSource(SourceConfig):
    """One outbox source: rows of ``table`` in the database at ``url`` (a SQLAlchemy
    URL, where ``${NAME}`` stands for the environment variable NAME), claimed ``batch``
    at a time; an idle outbox is looked at every ``poll`` at most (PostgreSQL's
    NOTIFY wakes the node sooner)."""

    type: ClassVar[str] = "outbox"
    env_field: ClassVar[str] = "url"
    url: str = field(repr=False)  # may hold a password
    table: str = DEFAULT_OUTBOX_TABLE
    batch: int = DEFAULT_OUTBOX_BATCH
    poll: float = DEFAULT_OUTBOX_POLL


def default_group(namespace: str, source_name: str) -> str:
    """The consumer group of a source that names none: ``coalescer.NAMESPACE.SOURCE``, so
    two namespaces (two deployments, a test and a deployment) never share a group."""
    return f"coalescer.{namespace}.{source_name}"


_Source = TypeVar("_Source", bound=SourceConfig)


def with_group(source: _Source, namespace: str) -> _Source:
    """``source`` with its consumer group filled in (the one derived from ``namespace``
    when its rules name none); a source without a group (an outbox) as it is."""
    if getattr(source, "group", None) != DEFAULT_GROUP:
        return source
    return replace(source, group=default_group(namespace, source.name))  # type: ignore[call-arg]


def with_own_group(source: _Source, namespace: str) -> _Source:
    """``source`` as a drain reads it: in the group derived from ``namespace`` even when
    its rules name one, so that a drain (a test's, in a namespace of its own) never reads
    with, nor commits for, a deployment's group; a source without a group as it is."""
    if getattr(source, "group", None) is None:
        return source
    return replace(source, group=default_group(namespace, source.name))  # type: ignore[call-arg]


def outbox_scheme(url: str) -> str | None:
    """``postgresql`` or ``sqlite`` for a URL of either (any ``+driver``), else None."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        return None
    return OUTBOX_SCHEMES.get(scheme.split("+", 1)[0].lower())


def outbox_url_problem(url: str) -> str | None:
    """What is wrong with a resolved outbox URL, or None."""
    scheme = outbox_scheme(url)
    if scheme is None:
        return ("must be a SQLAlchemy URL of PostgreSQL (postgresql://user:password@host/db, "
                "any +driver) or SQLite (sqlite:///path/to/file.db)")
    if scheme == "sqlite":
        path = url.partition("://")[2].partition("?")[0]
        if path in ("", "/", "/:memory:") or path.startswith("/file::memory:"):
            return ("names an in-memory SQLite database, which no other process can see: "
                    "name a file (sqlite:///path/to/file.db)")
    return None


def unset_env_warnings(file: str, sources: Sequence[SourceConfig],
                       environ: Mapping[str, str]) -> list[ConfigWarning]:
    """A warning for each environment variable a source's address uses (an outbox's
    url, a Kafka source's bootstrap: its ``env_field``) that is not set here (a worker
    node refuses to start without it)."""
    return [ConfigWarning(
        f"environment variable {name} is not set (or empty) here; source {source.name!r} "
        f"takes its {field} from it, so `coalescer run` refuses to start without it", file,
        source.line, f"sources[{index}].{field}")
        for index, source in enumerate(sources)
        for field, names in _env_refs(source)
        for name in dict.fromkeys(names) if not environ.get(name)]


def _env_refs(source: SourceConfig) -> list[tuple[str, list[str]]]:
    """The field of ``source`` that may name environment variables, and those names."""
    return [] if source.env_field is None else [(source.env_field, source.env_names)]


def source_error(source: SourceConfig, index: int, file: str, message: str,
                 name: str) -> ConfigError:
    """An error about ``source``, the ``index``-th, at its line, on its field ``name``."""
    return ConfigError(f"source {source.name!r}: {message}", file=file, line=source.line,
                       field=f"sources[{index}].{name}")


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
    config = SOURCE_TYPES[type_name].read(reader, item)
    times = _time_templates(reader, entries, prefix)
    if "at" in times:
        return replace(config, at=times["at"])
    if "delay" in times:
        return replace(config, delay=times["delay"])
    return config


def _time_templates(reader: YamlReader, entries: Entries,
                    prefix: str) -> dict[str, KeyTemplate]:
    """The source's ``at:`` or ``delay:`` template (not both); one without a field is
    checked here, as every event would carry that same time."""
    given = [name for name in TIME_FIELDS if name in entries]
    if len(given) > 1:
        raise reader.error("give at: or delay:, not both (a touch has one time)",
                           entries["delay"][1], f"{prefix}.delay")
    if not given:
        return {}
    name = given[0]
    node, where = entries[name][1], f"{prefix}.{name}"
    raw = reader.value(node, where)
    text = str(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else None
    text = text or reader.string(node, where, name)
    try:
        template = KeyTemplate.compile(text)
    except ValueError as exc:
        raise reader.error(str(exc).replace("key template", f"{name} template"), node,
                           where) from None
    if not template.fields:
        try:
            schedule_spec("(every event)", *((text, None) if name == "at" else (None, text)))
        except InvalidScheduleError as exc:
            raise reader.error(f"{name} {text!r}: {exc.reason}", node, where) from None
    return {name: template}


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
    return (*names, *TIME_FIELDS, "type")


def _stream(reader: YamlReader, item: SourceItem) -> StreamSource:
    entries, node, prefix = item.entries, item.node, item.prefix
    stream = reader.string(reader.require(entries, "stream", node, prefix, "the source"),
                           f"{prefix}.stream", "stream")
    group = read_group(reader, entries, prefix)
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


def read_group(reader: YamlReader, entries: Entries, prefix: str) -> str:
    """A source's ``group:`` as written (refused when empty), or DEFAULT_GROUP."""
    if "group" not in entries:
        return DEFAULT_GROUP
    node, field = entries["group"][1], f"{prefix}.group"
    group = reader.string(node, field, "group")
    if not group.strip():
        raise reader.error("group must name a consumer group; leave it out for the one "
                           "derived from the namespace", node, field)
    return group


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


def _outbox(reader: YamlReader, item: SourceItem) -> OutboxSource:
    entries, node, prefix = item.entries, item.node, item.prefix
    url = _outbox_url(reader, reader.require(entries, "url", node, prefix, "the source"),
                      f"{prefix}.url")
    table = reader.optional(entries, prefix, "table", _table(reader), DEFAULT_OUTBOX_TABLE)
    batch = reader.optional(entries, prefix, "batch",
                            lambda n, f: reader.positive_int(n, f, MAX_OUTBOX_BATCH),
                            DEFAULT_OUTBOX_BATCH)
    poll = reader.optional(entries, prefix, "poll", _poll(reader), DEFAULT_OUTBOX_POLL)
    return OutboxSource(name=item.name, url=url, table=table, batch=batch, poll=poll,
                        line=line_of(node))


def env_string(reader: YamlReader, node: Node, field: str, what: str) -> str:
    """The string ``what`` at ``node``, each of its ``${NAME}`` naming an environment
    variable."""
    raw = reader.string(node, field, what)
    for name in _ENV_REF.findall(raw):
        if _ENV_NAME.fullmatch(name) is None:
            raise reader.error(f"${{{name}}} must name an environment variable (letters, "
                               "digits and '_')", node, field)
    return raw


def _outbox_url(reader: YamlReader, node: Node, field: str) -> str:
    url = env_string(reader, node, field, "url")
    if url.startswith("${"):  # the scheme comes from the environment: checked at start
        return url
    problem = outbox_url_problem(_ENV_REF.sub("x", url))
    if problem is not None:
        raise reader.error(f"url {redact(url)!r} {problem}", node, field)
    return url


def _table(reader: YamlReader) -> Callable[[Node, str], str]:
    def parse(node: Node, field: str) -> str:
        raw = reader.string(node, field, "table")
        if _TABLE_RE.fullmatch(raw) is None:
            raise reader.error(f"table {shown(raw)} must be a table name, or schema.table "
                               "(letters, digits and '_')", node, field)
        return raw
    return parse


def _poll(reader: YamlReader) -> Callable[[Node, str], float]:
    def parse(node: Node, field: str) -> float:
        seconds = reader.positive_duration(node, field)
        if seconds > MAX_OUTBOX_POLL:
            raise reader.error(f"poll must be at most {format_duration(MAX_OUTBOX_POLL)}, "
                               f"got {format_duration(seconds)}", node, field)
        return seconds
    return parse


SOURCE_TYPES: dict[str, SourceFields] = {
    "stream": SourceFields(fields=STREAM_FIELDS, read=_stream),
    "outbox": SourceFields(fields=OUTBOX_FIELDS, read=_outbox),
}
"""The source types a rules file may name, by their ``type:``; a new type adds its entry."""
