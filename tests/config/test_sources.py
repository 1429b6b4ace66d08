"""The ``sources:`` block's ``type:`` field: ``stream`` by default, an unknown type
refused where it is written, and each type's own fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from coalescer.config.rules import Config
from coalescer.config.sources import (
    SOURCE_TYPES,
    SourceConfig,
    SourceFields,
    SourceItem,
    StreamSource,
    with_group,
)
from coalescer.config.yaml_reader import YamlReader, line_of
from coalescer.errors import ConfigError

BASE = """\
rules:
  - name: customer
    match: "stats:customer:{id}"
    handler: builtins:repr
sources:
"""


def load(sources: str) -> Config:
    return Config.from_string(BASE + sources, source="rules.yaml")


def test_a_source_of_type_stream_loads_as_one_without_a_type() -> None:
    typed = load("  - {name: a, type: stream, stream: s, key: 'stats:customer:{c}'}\n")
    plain = load("  - {name: a, stream: s, key: 'stats:customer:{c}'}\n")
    assert typed.sources == plain.sources
    (source,) = typed.sources
    assert isinstance(source, StreamSource)
    assert (source.type, source.stream, source.group) == ("stream", "s", "")


def test_a_source_without_a_group_reads_in_one_named_by_its_namespace() -> None:
    config = load("  - {name: orders, stream: s, key: 'stats:customer:{c}'}\n"
                  "  - {name: audit, stream: s, group: shared, key: 'stats:customer:{c}'}\n")
    orders, audit = config.sources
    assert with_group(orders, "dev").group == "coalescer.dev.orders"
    assert with_group(orders, "test-1").group == "coalescer.test-1.orders"
    assert with_group(audit, "dev").group == with_group(audit, "test-1").group == "shared"


def test_a_blank_group_is_refused_where_it_is_written() -> None:
    with pytest.raises(ConfigError) as raised:
        load("  - {name: a, stream: s, group: '  ', key: 'stats:customer:{c}'}\n")
    assert (raised.value.line, raised.value.field) == (6, "sources[0].group")
    assert "leave it out for the one derived from the namespace" in str(raised.value)


@pytest.mark.parametrize("value", ["nats", "[stream]", "''", "Stream"])
def test_an_unknown_type_is_refused_with_file_line_field_and_the_known_types(
        value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(f"  - {{name: a, type: {value}, stream: s, key: 'stats:customer:{{c}}'}}\n")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", 6, "sources[0].type")
    assert "unknown source type" in err.message
    assert err.message.endswith("known types: stream, outbox, kafka")


@dataclass(frozen=True, kw_only=True, slots=True)
class ListSource(SourceConfig):
    """A source type of this test: keys named in the file."""

    type: ClassVar[str] = "list"
    keys: tuple[str, ...]


def _read_list(reader: YamlReader, item: SourceItem) -> ListSource:
    field = f"{item.prefix}.keys"
    node = reader.require(item.entries, "keys", item.node, item.prefix, "the source")
    raw = reader.value(node, field)
    return ListSource(name=item.name, keys=tuple(map(str, raw)), line=line_of(item.node))


@pytest.fixture
def list_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SOURCE_TYPES, "list", SourceFields(fields=("keys",), read=_read_list))


@pytest.mark.usefixtures("list_type")
def test_a_registered_type_reads_its_own_fields() -> None:
    config = load("  - {name: a, stream: s, key: 'stats:customer:{c}'}\n"
                  "  - {name: b, type: list, keys: [stats:customer:1]}\n")
    stream, listed = config.sources
    assert isinstance(stream, StreamSource)
    assert listed == ListSource(name="b", keys=("stats:customer:1",), line=7)


@pytest.mark.usefixtures("list_type")
def test_a_field_of_another_type_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load("  - {name: b, type: list, keys: [x], stream: s}\n")
    err = info.value
    assert (err.line, err.field) == (6, "sources[0].stream")
    assert err.message == ("field 'stream' is not a field of a list source; "
                           "allowed: name, type, at, delay, keys")
    with pytest.raises(ConfigError) as info:
        load("  - {name: a, stream: s, key: 'stats:customer:{c}', keys: [x]}\n")
    assert info.value.field == "sources[0].keys"
    assert "not a field of a stream source" in info.value.message


@pytest.mark.usefixtures("list_type")
def test_an_unknown_field_lists_the_fields_of_every_type() -> None:
    with pytest.raises(ConfigError) as info:
        load("  - {name: a, stream: s, key: 'stats:customer:{c}', shard: 1}\n")
    assert info.value.message.endswith(
        "allowed: name, stream, group, start, key, item, url, table, batch, poll, bootstrap, "
        "topics, stalled_after, keys, at, delay, type")
