"""The model's fairness check: a fair rule's groups share its claims by their weights.

Start-time fair queueing gives every group that keeps keys waiting its weight's share of
the starts: while a key of group ``g`` waits (from when it could first be claimed to its
start), another group ``h`` gets at most ``w_h / w_g`` starts for each start of ``g``,
plus the order's own slack of one key of each (``1 + w_h / w_g``), plus ``SLACK`` starts
for the moments the check cannot see: the run in flight when the key fell due, the
claim call that had not yet read it, a leader hand-over. A first-come order fails it at
once: a group's key falling due behind another's import waits for the whole import.

The check holds for one shard's order (the model's fair keys all live in one shard,
whatever the shard count), at one claim a call (``concurrency: 1``), so each start is
one claim. A wait is left out when something the check cannot order ran through it: a
SIGKILL (a claim it lost waits for its lease), a failover, a retry or a re-run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tests.helpers.model_history import MS, SETTLE_AFTER_FAILOVER, History, Run

SLACK = 3


@dataclass(frozen=True)
class Wait:
    """A key of ``group`` claimable from ``since`` until its run started at ``until``."""

    key: str
    group: str
    since: int
    until: int


def group_of(key: str) -> str:
    return key.split(":")[1]


def check_share(history: History, runs: dict[str, list[Run]], rule_of: Callable[[str], str],
                rule: str, weights: dict[str, float]) -> list[str]:
    """While a key of one group waits, no other group starts more than its weight's
    share of the claims (see the module's docstring for the bound)."""
    mine = {key: rs for key, rs in runs.items() if rule_of(key) == rule}
    starts = sorted((r.start, group_of(r.key)) for rs in mine.values() for r in rs)
    out = []
    for wait in _waits(history, mine):
        counts: dict[str, int] = {}
        for t, group in starts:
            if wait.since < t < wait.until:
                counts[group] = counts.get(group, 0) + 1
        ahead = counts.pop(wait.group, 0)
        for other, n in counts.items():
            ratio = weights.get(other, 1.0) / weights.get(wait.group, 1.0)
            allowed = math.floor(ratio * ahead + 1 + ratio) + SLACK
            if n > allowed:
                out.append(f"share: {wait.key} (group {wait.group}) waited "
                           f"{(wait.until - wait.since) // MS} ms while group {other} "
                           f"started {n} refreshes and its own {ahead} (at most {allowed})")
    return out


def _waits(history: History, runs: dict[str, list[Run]]) -> list[Wait]:
    """Each key's first tries, from when they could be claimed (their due time, or the
    end of the key's run before) to their start; none that a fault ran through."""
    faults = [(when, when) for _, when in history.kills]
    faults += [(t0, t1 + SETTLE_AFTER_FAILOVER) for t0, t1 in history.failovers]
    out = []
    for key, rs in runs.items():
        for i, run in enumerate(rs):
            before = rs[i - 1] if i else None
            if run.attempt > 1 or (before is not None and before.due_ms == run.due_ms):
                continue  # a retry, or a re-run of a claim whose node died
            since = max(run.due_ms * MS, (before.end or run.start) if before else 0)
            if not any(a <= run.start and since <= b for a, b in faults):
                out.append(Wait(key, group_of(key), since, run.start))
    return out
