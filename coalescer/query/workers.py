"""Whether a worker runs for a rule: the hint that nothing will refresh its keys (what
`coalescer status`, `explain`, the HTTP API and the page then say: docs/cli.md, under
`status`). A rule is served while some live worker node lists it in its rules registry
entry (``registry_status``). Adds to the status dict, per source, ``unread`` (true while
no worker node lives); to an explanation, ``no_worker`` and ``unread_sources``.
"""

from __future__ import annotations

from typing import Any

from coalescer.common.plural import noun
from coalescer.config.rules import Config, Rule
from coalescer.query.registry_status import live_rules
from coalescer.store.hints import CommandHints
from coalescer.store.keys import ShardKeys

NO_WORKER = "no worker is running for this rule"
NOT_REFRESHED = "pending keys will not be refreshed until one starts"


def start_command(hints: CommandHints) -> str:
    """"(`coalescer run ...`)": the command that starts a worker, with its options."""
    return f"({hints.command('run')}{hints.note})"


def no_worker_hint(hints: CommandHints) -> str:
    """"no worker is running for this rule: pending keys will not be refreshed until one
    starts (`coalescer run`)"."""
    return f"{NO_WORKER}: {NOT_REFRESHED} {start_command(hints)}"


def mark_unread(status: dict[str, Any]) -> None:
    """Flag every source of ``status`` (after add_registry and add_sources) as unread
    while no worker node lives."""
    unread = not status.get("nodes")
    for source in status.get("sources", {}).values():
        source["unread"] = unread


async def add_workers(redis: Any, config: Config, rule: Rule, sk: ShardKeys,
                      info: dict[str, Any]) -> None:
    """Extend an explanation: ``no_worker`` and ``unread_sources`` (``sk``: shard 0)."""
    live = await live_rules(redis, sk, config)
    info["no_worker"] = not any(rule.name in rules for rules in live.values())
    info["unread_sources"] = [] if live else [s.name for s in config.sources]


def status_worker_lines(status: dict[str, Any], hints: CommandHints) -> list[str]:
    """Under the rules table: why the rules marked "no worker is running for this rule"
    run nothing, and the command that starts a worker (no line when every rule has one)."""
    lacking = [name for name, r in status["rules"].items() if r.get("no_worker")]
    if not lacking:
        return []
    if not status.get("nodes"):
        unread = ", and no source is read," if status.get("sources") else ""
        return [f"no worker is running: no node has renewed its lease; pending keys will "
                f"not be refreshed{unread} until one starts {start_command(hints)}"]
    return [f"no live node's rules file has {noun(len(lacking), 'rule')} {', '.join(lacking)}: "
            f"pending keys will not be refreshed until a worker with "
            f"{noun(len(lacking), 'it', 'them')} starts {start_command(hints)}"]


def explain_worker_lines(info: dict[str, Any], hints: CommandHints) -> list[str]:
    """An explanation's lines when no worker runs for its rule: overdue keys read as
    such, and sources no node reads are named."""
    lines = []
    if info.get("no_worker"):
        overdue = info["state"] in ("pending", "backoff") and info["due_ms"] <= info["now_ms"]
        lines.append(("overdue: " if overdue else "") + no_worker_hint(hints))
    unread = info.get("unread_sources")
    if unread:
        lines.append(f"{noun(len(unread), 'source')} {', '.join(unread)} "
                     f"{noun(len(unread), 'is', 'are')} not being read (no worker is "
                     "running): touches waiting there do not show here until one starts")
    return lines
