"""What `coalescer check` adds to the rules file's own checks: the errors that would
make `coalescer run` refuse its sources on this machine (a database driver or aiokafka
not installed), a line per source, and with ``-v`` how each Python handler runs."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from coalescer.common.redact import redact
from coalescer.config.durations import format_duration
from coalescer.config.handler_import import HandlerImport, is_async
from coalescer.config.kafka_source import KafkaSource
from coalescer.config.model import HttpHandler, Rule
from coalescer.config.rules import CheckReport, Config
from coalescer.config.sources import (
    OutboxSource,
    SourceConfig,
    StreamSource,
    source_error,
    with_group,
)
from coalescer.errors import ConfigError

KAFKA_DRIVER = "reading Kafka needs aiokafka: pip install 'coalescer[kafka]'"


def source_errors(report: CheckReport) -> list[ConfigError]:
    """Why `coalescer run` would refuse the sources of ``report``'s rules here; an
    environment variable that is not set stays the warning ``check`` gives already."""
    config = report.config
    if config is None or not config.sources:
        return []
    from coalescer.sources.base import check_sources  # registers the source types
    warned = {warning.field for warning in report.warnings}
    errors = [e for e in check_sources(config, os.environ) if e.field not in warned]
    for index, source in enumerate(config.sources):
        if isinstance(source, KafkaSource) and f"sources[{index}].bootstrap" in warned:
            errors += _kafka_driver(source, index, config.source)
    return sorted(errors, key=lambda error: error.line or 0)


def _kafka_driver(source: KafkaSource, index: int, file: str) -> list[ConfigError]:
    """aiokafka missing, for a source whose bootstrap could not be checked here."""
    try:
        importlib.import_module("aiokafka")
    except ImportError:
        return [source_error(source, index, file, KAFKA_DRIVER, "type")]
    return []


def describe_sources(config: Config) -> str:
    """A line per source: its type, name, line and what it reads ("" without any)."""
    if not config.sources:
        return ""
    lines = [f"{len(config.sources)} source(s):"]
    lines += [f"   {source.type} {source.name}  (line {source.line}): "
              f"{reads(with_group(source, config.namespace))}" for source in config.sources]
    return "\n".join(lines)


def reads(source: SourceConfig) -> str:
    """What ``source`` reads and touches, its URL's password hidden."""
    if isinstance(source, StreamSource):
        return (f"reads stream {source.stream!r} (group {source.group}, start "
                f"{source.start}), touches {source.key.source}")
    if isinstance(source, OutboxSource):
        return (f"reads table {source.table} of {redact(source.url)} (batch {source.batch}, "
                f"polled every {format_duration(source.poll)} at most), touches each row's key")
    if isinstance(source, KafkaSource):
        return (f"reads topic(s) {', '.join(source.topics)} from {redact(source.bootstrap)} "
                f"(group {source.group}, start {source.start}), touches {source.key.source}")
    return "reads its own kind of events"


def source_json(sources: Sequence[SourceConfig], namespace: str) -> list[dict[str, Any]]:
    """``check --json``'s sources: type, name, line, what each reads, and the consumer
    group it reads in (a stream's or Kafka source's; its default derived from
    ``namespace``)."""
    shown = [with_group(s, namespace) for s in sources]
    return [{"type": s.type, "name": s.name, "line": s.line, "reads": reads(s),
             **({"group": group} if (group := getattr(s, "group", None)) else {})}
            for s in shown]


def handler_lines(config: Config) -> str:
    """``check -v``: how each rule's handler runs and where it is defined."""
    return "\n".join(f"   {rule.name}: {_handler(rule)}" for rule in config.rules)


def _handler(rule: Rule) -> str:
    handler = rule.handler
    if isinstance(handler, HttpHandler):
        return f"webhook {handler}"
    if isinstance(handler, HandlerImport):
        return f"{handler} (not imported: --no-import)"
    if is_async(handler):
        kind = "async def: runs on the node's event loop"
    elif rule.isolation is not None:
        kind = "def: runs in a child process (isolation: process)"
    else:
        kind = "def: runs on a worker thread (isolation: thread)"
    return f"{kind}, defined in {_where(handler)}"


def _where(handler: Callable[..., object]) -> str:
    target = inspect.unwrap(handler)
    try:
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (OSError, TypeError):
        return "a place whose source cannot be found"
