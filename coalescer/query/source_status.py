"""Stream sources in `coalescer status`: each source's lag, pending and rejected entries.

Adds ``sources: {NAME: {"stream", "group", "lag", "pending", "rejected"}}`` to the
status dict (empty without sources): ``lag`` is how many entries of the stream the
group has not read yet (``XINFO GROUPS``; null when the server cannot tell, or the
stream or group does not exist), ``pending`` how many were read and not yet
acknowledged, ``rejected`` how many were rejected since the namespace began.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import ResponseError

from coalescer.config.rules import Config
from coalescer.config.sources import Source
from coalescer.store.keys import sources_rejected


async def add_sources(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend ``status`` with the sources of ``config``: one read per stream, plus one."""
    if not config.sources:
        status["sources"] = {}
        return
    rejected, *groups = await asyncio.gather(
        redis.hgetall(sources_rejected(config.namespace)),
        *(_group(redis, source) for source in config.sources))
    status["sources"] = {
        source.name: {"stream": source.stream, "group": source.group,
                      "lag": _int(found.get("lag")), "pending": _int(found.get("pending")),
                      "rejected": int(rejected.get(source.name, 0))}
        for source, found in zip(config.sources, groups, strict=True)}


async def _group(redis: Any, source: Source) -> dict[str, Any]:
    """The group's XINFO GROUPS entry; empty when the stream or the group is missing."""
    try:
        groups = await redis.xinfo_groups(source.stream)
    except ResponseError:  # no such key, or it is not a stream
        return {}
    for group in groups:
        if group.get("name") == source.group:
            return dict(group)
    return {}


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def format_sources(status: dict[str, Any]) -> list[str]:
    """Lines for the human status: one per source (none without sources)."""
    sources = status.get("sources") or {}
    if not sources:
        return []
    lines = ["", f"{'SOURCE':<24} {'LAG':>8} {'PENDING':>8} {'REJECTED':>9}  STREAM (GROUP)"]
    for name, s in sources.items():
        lag = "?" if s["lag"] is None else s["lag"]
        pending = "?" if s["pending"] is None else s["pending"]
        lines.append(f"{name:<24} {lag:>8} {pending:>8} {s['rejected']:>9}  "
                     f"{s['stream']} ({s['group']})")
    return lines
