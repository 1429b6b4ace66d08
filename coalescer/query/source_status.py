"""Sources in `coalescer status`: what each source's type shows, and its rejected entries.

Adds ``sources: {NAME: {..., "rejected"}}`` to the status dict (empty without sources);
each type's fields (a stream's lag and pending entries, an outbox's backlog, lag and
errors, a Kafka source's partitions) are docs/sources.md's "Sources in coalescer
status", "The outbox in coalescer status" and "The Kafka source in coalescer status". A
source of a type not registered here shows its ``type`` only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from coalescer.common.printable import printable
from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig, with_group
from coalescer.sources.base import SOURCE_TYPES
from coalescer.store.keys import sources_rejected

NOT_READ = "its events are not being read: no worker is running"


async def add_sources(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend ``status`` with the sources of ``config``: one read per stream, plus one."""
    if not config.sources:
        status["sources"] = {}
        return
    rejected, *shown = await asyncio.gather(
        redis.hgetall(sources_rejected(config.namespace)),
        *(_shown(redis, source, config) for source in config.sources))
    status["sources"] = {
        source.name: {**found, "rejected": int(rejected.get(source.name, 0))}
        for source, found in zip(config.sources, shown, strict=True)}


async def _shown(redis: Any, source: SourceConfig, config: Config) -> dict[str, Any]:
    """What the source's type shows of it; its type alone for a type not registered."""
    source_type = SOURCE_TYPES.get(source.type)
    if source_type is None:
        return {"type": source.type}
    return await source_type.status(redis, with_group(source, config.namespace), config)


def format_sources(status: dict[str, Any]) -> list[str]:
    """Lines for the human status: one per source (none without sources)."""
    sources = status.get("sources") or {}
    if not sources:
        return []
    lines = ["", f"{'SOURCE':<24} {'LAG':>8} {'PENDING':>8} {'REJECTED':>9}  STREAM (GROUP)"
             " OR OUTBOX TABLE AT URL OR KAFKA TOPICS (GROUP)"]
    for name, s in sources.items():
        lines += _type_lines(name, s)
        if s.get("unread"):
            lines.append(f"{'':<24} {NOT_READ}")
    return lines


def _type_lines(name: str, s: dict[str, Any]) -> list[str]:
    """A source's lines, as its type shows it."""
    if s.get("type") == "outbox":
        return _outbox_lines(name, s)
    if s.get("type") == "kafka":
        return _kafka_lines(name, s)
    lag = "?" if s.get("lag") is None else s["lag"]
    pending = "?" if s.get("pending") is None else s["pending"]
    what = f"{s['stream']} ({s['group']})" if "stream" in s else f"({s.get('type')})"
    return [f"{name:<24} {lag:>8} {pending:>8} {s['rejected']:>9}  {what}"]


def _outbox_lines(name: str, s: dict[str, Any]) -> list[str]:
    """An outbox source: its lag in seconds, its backlog, then one line per node failing."""
    lag = "?" if s.get("lag_seconds") is None else f"{s['lag_seconds']:.1f}s"
    backlog = "?" if s.get("backlog") is None else str(s["backlog"])
    backlog = f">={backlog}" if s.get("backlog_capped") else backlog
    lines = [f"{name:<24} {lag:>8} {backlog:>8} {s['rejected']:>9}  outbox {s['table']} at "
             f"{s['url']}"]
    lines += [f"{'':<24} error on {printable(node)}: {printable(error)}"
              for node, error in sorted((s.get("errors") or {}).items())]
    return lines


def _kafka_lines(name: str, s: dict[str, Any]) -> list[str]:
    """A Kafka source: its total lag, then one line per partition and per node failing."""
    lag = "?" if s.get("lag") is None else s["lag"]
    lines = [f"{name:<24} {lag:>8} {'':>8} {s['rejected']:>9}  kafka {','.join(s['topics'])} "
             f"({s['group']})"]
    for partition, p in s.get("partitions", {}).items():
        shown = "?" if p.get("lag") is None else p["lag"]
        lines.append(f"{'':<24} {shown:>8} {'':>8} {'':>9}  {printable(partition)} on "
                     f"{printable(p.get('node'))} (committed {p.get('committed')})")
    lines += [f"{'':<24} error on {printable(node)}: {printable(error)}"
              for node, error in sorted((s.get("errors") or {}).items())]
    return lines
