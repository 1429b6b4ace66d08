"""The ``type: kafka`` source of a rules file: messages of Kafka topics become touches.
Its fields (``bootstrap``, ``topics``, ``group``, ``start``, ``key``, ``item``,
``batch``, ``stalled_after``) and how each is checked: docs/sources.md, "The Kafka
source". Importing this module adds the type to the ``sources:`` block's readers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from yaml.nodes import Node, SequenceNode

from coalescer.config.sources import (
    DEFAULT_GROUP,
    SOURCE_TYPES,
    SourceConfig,
    SourceFields,
    SourceItem,
    _item_template,
    _template,
    env_string,
    read_group,
)
from coalescer.config.templates import KeyTemplate
from coalescer.config.yaml_reader import YamlReader, line_of, shown

KAFKA_FIELDS = ("bootstrap", "topics", "group", "start", "key", "item", "batch",
                "stalled_after")
KAFKA_STARTS = ("earliest", "latest")
DEFAULT_KAFKA_BATCH = 5000  # messages read and not yet flushed, at most, per source and node
MAX_KAFKA_BATCH = 100_000
# seconds a source may go without a partition on any node (or without reading while
# messages wait) before /healthz fails
DEFAULT_STALLED_AFTER = 60.0
_ADDRESS = re.compile(r"[^\s,:]+:[0-9]{1,5}")
# Kafka's own limit: letters, digits, '.', '_' and '-', at most 249 characters.
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KafkaSource(SourceConfig):
    """One Kafka source: each message of ``topics`` touches ``key`` filled from the fields
    of its value (a JSON object), read in the consumer group ``group``."""

    type: ClassVar[str] = "kafka"
    env_field: ClassVar[str] = "bootstrap"
    bootstrap: str = field(repr=False)  # may hold ${NAME} references
    topics: tuple[str, ...]
    group: str = DEFAULT_GROUP
    start: str = "latest"  # where a group with no committed offset begins
    key: KeyTemplate
    item: KeyTemplate | None = None
    batch: int = DEFAULT_KAFKA_BATCH
    stalled_after: float = DEFAULT_STALLED_AFTER

    def resolved_bootstrap(self, environ: Mapping[str, str]) -> str:
        """``bootstrap`` with its ``${NAME}`` resolved (see ``resolved``)."""
        return self.resolved(environ)


def bootstrap_problem(bootstrap: str) -> str | None:
    """What is wrong with a resolved ``bootstrap``, or None."""
    addresses = [part.strip() for part in bootstrap.split(",")]
    for address in addresses:
        if _ADDRESS.fullmatch(address) is None:
            return (f"{shown(address)} is not host:port; bootstrap is a list of host:port, "
                    "comma-separated (127.0.0.1:9092,broker2:9092)")
    return None


def _kafka(reader: YamlReader, item: SourceItem) -> KafkaSource:
    entries, node, prefix = item.entries, item.node, item.prefix
    bootstrap = _bootstrap(reader, reader.require(entries, "bootstrap", node, prefix,
                                                  "the source"), f"{prefix}.bootstrap")
    topics = _topics(reader, reader.require(entries, "topics", node, prefix, "the source"),
                     f"{prefix}.topics")
    group = read_group(reader, entries, prefix)
    start = reader.optional(entries, prefix, "start", _start(reader), "latest")
    key = _template(reader, reader.require(entries, "key", node, prefix, "the source"),
                    f"{prefix}.key", item.patterns)
    touched_item = None
    if "item" in entries:
        touched_item = _item_template(reader, entries["item"][1], f"{prefix}.item", key,
                                      item.item_patterns)
    batch = reader.optional(entries, prefix, "batch",
                            lambda n, f: reader.positive_int(n, f, MAX_KAFKA_BATCH),
                            DEFAULT_KAFKA_BATCH)
    stalled_after = reader.optional(entries, prefix, "stalled_after",
                                    reader.positive_duration, DEFAULT_STALLED_AFTER)
    return KafkaSource(name=item.name, bootstrap=bootstrap, topics=topics, group=group,
                       start=start, key=key, item=touched_item, batch=batch,
                       stalled_after=stalled_after, line=line_of(node))


def _bootstrap(reader: YamlReader, node: Node, field: str) -> str:
    raw = env_string(reader, node, field, "bootstrap")
    # an address with ${NAME} in it is checked when a node starts, once resolved
    known = ",".join(part for part in raw.split(",") if "${" not in part)
    problem = bootstrap_problem(known) if known else None
    if problem is not None:
        raise reader.error(f"bootstrap {problem}", node, field)
    return raw


def _topics(reader: YamlReader, node: Node, field: str) -> tuple[str, ...]:
    if not isinstance(node, SequenceNode) or not node.value:
        raise reader.error("topics must be a non-empty list of topic names ([orders])",
                           node, field)
    topics: list[str] = []
    for index, topic_node in enumerate(node.value):
        topic = reader.string(topic_node, f"{field}[{index}]", "a topic")
        if _TOPIC.fullmatch(topic) is None:
            raise reader.error(f"topic {shown(topic)} is not a Kafka topic name (letters, "
                               "digits, '.', '_' and '-', up to 249)", topic_node,
                               f"{field}[{index}]")
        if topic in topics:
            raise reader.error(f"topic {topic!r} is listed twice", topic_node,
                               f"{field}[{index}]")
        topics.append(topic)
    return tuple(topics)


def _start(reader: YamlReader) -> Callable[[Node, str], str]:
    def parse(node: Node, field: str) -> str:
        raw = reader.value(node, field)
        if raw not in KAFKA_STARTS:
            raise reader.error("start must be 'earliest' (every message the topics hold) "
                               "or 'latest' (only messages published from now on), got "
                               f"{shown(raw)}", node, field)
        return str(raw)
    return parse


SOURCE_TYPES[KafkaSource.type] = SourceFields(fields=KAFKA_FIELDS, read=_kafka)
