"""Rates in `coalescer status`: each rated rule's rate and the keys due now.

Adds ``rate`` (``"200/s"``, or null) to every rule of the status dict and, to a rule
with a rate, ``due_now``: its keys whose due time has come and that no node has
claimed yet, over every shard. They wait for the rule's rate (or for a free
handler slot), so their start lag grows; a rule without a rate that keeps keys due
now is short of slots, which ``pending`` and the start-lag histogram show already.
One pipelined round trip, made only when some rule has a rate.
"""

from __future__ import annotations

from typing import Any

from coalescer.common.plural import plural
from coalescer.config.rules import Config
from coalescer.store.keys import KeySpace


async def add_rates(redis: Any, config: Config, status: dict[str, Any]) -> None:
    """Extend ``status["rules"]`` with each rule's rate, and a rated rule's ``due_now``."""
    rated = [r.name for r in config.rules if r.rate is not None]
    for rule in config.rules:
        entry = status["rules"].setdefault(rule.name, {})
        entry["rate"] = None if rule.rate is None else str(rule.rate)
    if not rated:
        return
    seconds, micros = await redis.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    space = KeySpace(config.namespace, len(status["shards"]))  # every shard status read
    pipe = redis.pipeline(transaction=False)
    for sk in space.all_shards():
        for name in rated:
            pipe.zcount(sk.due(name), "-inf", now)
    counts = iter(await pipe.execute())
    totals = dict.fromkeys(rated, 0)
    for _ in space.all_shards():
        for name in rated:
            totals[name] += int(next(counts))
    for name, total in totals.items():
        status["rules"][name]["due_now"] = total


def format_rates(status: dict[str, Any]) -> list[str]:
    """A RATES section: one line per rule with a rate (nothing without one)."""
    rated = {name: r for name, r in status["rules"].items() if r.get("rate")}
    if not rated:
        return []
    lines = ["", "RATES (refresh starts, cluster-wide; keys due now wait for them)"]
    for name, r in rated.items():
        lines.append(f"  {name:<24} {r['rate']:>10}  "
                     f"{plural(r.get('due_now', 0), 'key')} due now")
    return lines
