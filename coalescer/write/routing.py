"""Which shard each key of a write goes to, under the layout a writer follows.

Outside a reshard a key goes to ``shard_of(key)``. While one runs, a key whose old
and new shards differ goes to its old shard "held": written there only if that shard
still holds it (it has not been moved yet), else asked back and then written to its
new shard (see store/layout.py). A key whose two shards are one goes there as usual.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import replace

from coalescer.store.keys import KeySpace
from coalescer.store.script_types import UpsertGroup

Routed = list[tuple[int, list[UpsertGroup]]]


def part(group: UpsertGroup, keys: Sequence[str], *, held: bool | None = None) -> UpsertGroup:
    """``group`` with only ``keys`` (and their items and times); ``held`` changed if
    given."""
    held = group.held if held is None else held
    if not group.items and not group.schedules:
        return replace(group, keys=keys, held=held)
    items, times = group.items or {}, group.schedules or {}
    return replace(group, keys=keys, held=held,
                   items={k: items[k] for k in keys if k in items} or None,
                   schedules={k: times[k] for k in keys if k in times} or None)


def mark_held(keyspace: KeySpace, shard: int, groups: list[UpsertGroup]) -> list[UpsertGroup]:
    """Groups of keys bound for old shard ``shard`` (by ``source_of``), split in the
    keys whose new shard it is too, and the held ones."""
    if not keyspace.resharding:
        return groups
    out: list[UpsertGroup] = []
    for g in groups:
        home = [k for k in g.keys if keyspace.shard_of(k) == shard]
        held = [k for k in g.keys if keyspace.shard_of(k) != shard] if home else list(g.keys)
        if home:
            out.append(part(g, home, held=False))
        if held:
            out.append(part(g, held, held=True))
    return out


def route(keyspace: KeySpace, groups: Sequence[UpsertGroup]) -> Routed:
    """``groups`` split by the shard each key goes to now (held where it must be)."""
    by_shard: dict[int, list[UpsertGroup]] = defaultdict(list)
    for g in groups:
        parts: dict[int, list[str]] = defaultdict(list)
        for key in g.keys:
            parts[keyspace.source_of(key)].append(key)
        for shard, keys in parts.items():
            by_shard[shard] += mark_held(keyspace, shard, [part(g, keys, held=False)])
    return list(by_shard.items())


def route_asked(keyspace: KeySpace, groups: Sequence[UpsertGroup],
                asked: Collection[str]) -> Routed:
    """The ``asked`` keys of ``groups`` (an old shard no longer holds them), by the
    new shard each goes to."""
    by_shard: dict[int, list[UpsertGroup]] = defaultdict(list)
    for g in groups:
        parts: dict[int, list[str]] = defaultdict(list)
        for key in g.keys:
            if key in asked:
                parts[keyspace.shard_of(key)].append(key)
        for shard, keys in parts.items():
            by_shard[shard].append(part(g, keys, held=False))
    return list(by_shard.items())
