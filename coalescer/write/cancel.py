"""Cancel: drop keys' pending refreshes, one atomic script call per shard.

What a cancel drops (``store/lua/cancel.lua``): a pending key's refresh (its state
and due entry, retry backoff and attempts with it), and the re-arm a running key
recorded from touches made while it ran (the running refresh itself finishes as
usual). A dead-lettered key is not pending: ``coalescer dead purge`` deletes it.
The touches of the keys still buffered in this process are dropped first (see
``Flusher.forget``), so that no touch made before the cancel reaches Redis after it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coalescer.store.keys import KeySpace
from coalescer.store.layout import carry
from coalescer.store.script_types import CancelGroup, History
from coalescer.store.scripts import Scripts

BATCH = 500  # keys per script call: a few ms of Redis time at most

DROPPED = ("pending", "rearm", "buffered")  # the states in which a cancel dropped something


@dataclass(frozen=True, slots=True)
class CancelOutcome:
    """What a cancel did: the keys whose refresh it dropped, and the named keys that
    were not pending, with the state each key was found in.

    States: ``pending`` (its refresh, or retry, was dropped), ``rearm`` (running; the
    refresh its touches during the run had queued was dropped), ``buffered`` (only
    touches still buffered in this process, not yet in Redis, were dropped);
    and, not pending: ``running`` (running with nothing queued after it: the running
    refresh is never stopped), ``dead`` (dead-lettered: see ``purge_dead``),
    ``idle`` (nothing to cancel).
    """

    cancelled: list[str] = field(default_factory=list)
    not_pending: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> int:
        """How many keys had their refresh dropped (as ``DeadOutcome.done``)."""
        return len(self.cancelled)

    def to_json(self) -> dict[str, Any]:
        return {"cancelled": self.cancelled, "not_pending": self.not_pending,
                "states": self.states}


def _calls(rules: Mapping[str, str],
           shard_of: Callable[[str], int]) -> list[tuple[int, list[CancelGroup]]]:
    """One script call per shard and BATCH keys (a Redis Cluster runs each on the node of
    its shard's slot), its keys grouped by rule."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for key in rules:
        by_shard[shard_of(key)].append(key)
    calls = []
    for shard, keys in by_shard.items():
        for i in range(0, len(keys), BATCH):
            by_rule: dict[str, list[str]] = defaultdict(list)
            for key in keys[i:i + BATCH]:
                by_rule[rules[key]].append(key)
            calls.append((shard, [CancelGroup(rule, group) for rule, group in by_rule.items()]))
    return calls


async def cancel_keys(scripts: Scripts, keyspace: KeySpace, rules: Mapping[str, str], *,
                      history: History,
                      buffered: set[str] | frozenset[str] = frozenset()) -> CancelOutcome:
    """Cancel the keys of ``rules`` (key -> its rule's name; see the module), in its
    order; ``buffered`` are the keys whose buffered touches were dropped already.
    While a reshard runs, a key found idle in its old shard is looked for in its new
    one (put there first if it was in transit: its mover had not put it yet)."""
    found, seq, transit = await _cancel(scripts, keyspace, rules, keyspace.source_of, history)
    if keyspace.resharding:
        moved = {key: rule for key, rule in rules.items() if found[key] == "idle"
                 and keyspace.shard_of(key) != keyspace.source_of(key)}
        if transit:
            await carry(scripts, keyspace, seq, transit)
        if moved:
            found.update((await _cancel(scripts, keyspace, moved, keyspace.shard_of,
                                        history))[0])
    outcome = CancelOutcome()
    for key in rules:
        state = found[key]
        if state not in DROPPED and key in buffered:
            state = "buffered"
        outcome.states[key] = state
        (outcome.cancelled if state in DROPPED else outcome.not_pending).append(key)
    return outcome


async def _cancel(scripts: Scripts, keyspace: KeySpace, rules: Mapping[str, str],
                  shard_of: Callable[[str], int],
                  history: History) -> tuple[dict[str, str], int, list[str]]:
    """The state each key was found in, and the bundles of the keys in transit with
    the highest fencing tokens of their shards."""
    calls = _calls(rules, shard_of)
    answers = await asyncio.gather(*(scripts.cancel(keyspace.shard(shard), groups, history)
                                      for shard, groups in calls))
    found = {key: state for answer in answers for key, state in answer.states.items()}
    return (found, max((a.seq for a in answers), default=0),
            [b for a in answers for b in a.transit])
