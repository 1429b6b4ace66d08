"""The write side's script wrappers: scheduling touched keys, cancelling them, the
shards' limits, and the trace contexts kept beside keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coalescer.common.plural import plural
from coalescer.errors import LayoutMovedError, ScriptError
from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import KEY_SEPARATOR, ScriptCalls
from coalescer.store.script_types import (
    NO_HISTORY,
    CancelAnswer,
    CancelGroup,
    History,
    LimitsAnswer,
    UpsertGroup,
    UpsertResult,
)

# What cancel.lua found each key in: the first two had a refresh to drop (see cancel.lua).
CANCEL_STATES = ("pending", "rearm", "running", "dead", "idle")


def _upsert_items(groups: Sequence[UpsertGroup]) -> list[Any]:
    """The items section of an upsert call (none for plain touches)."""
    args: list[Any] = []
    for g in groups:
        if g.items:
            fields: list[str] = []
            for key, items in g.items.items():
                fields += (key, str(len(items)), *items)
            args += [g.items_max, KEY_SEPARATOR.join(fields)]
    return args


def _upsert_times(group: UpsertGroup) -> str:
    """The times section of a group ("" for plain touches): KEY NUL TIME NUL ..."""
    if not group.schedules:
        return ""
    return KEY_SEPARATOR.join(f for pair in group.schedules.items() for f in pair)


class WriteScripts(ScriptCalls):
    """Writing keys' schedules and dropping them."""

    async def upsert(self, shard: ShardKeys, groups: Sequence[UpsertGroup]) -> int:
        """Schedule the groups' keys; returns how many. ScriptError if a key failed."""
        result = await self.upsert_keys(shard, groups)
        if result.failed:
            raise ScriptError(f"upsert failed for {plural(len(result.failed), 'key')}: "
                              f"{sorted(result.failed.items())[:3]!r}")
        return result.scheduled

    async def upsert_keys(self, shard: ShardKeys, groups: Sequence[UpsertGroup],
                          gen: int = 1, min_seq: int = 0) -> UpsertResult:
        """Schedule the groups' keys, written with layout generation ``gen``; the keys
        Redis failed on are skipped and returned. ``min_seq``: the tokens granted by
        the old shard that asked these keys away. LayoutMovedError: the shard follows
        a newer layout, and nothing was written."""
        keys = [shard.meta, shard.next_wake, shard.layout, shard.seq, shard.moving,
                shard.bytes]
        args: list[Any] = [shard.wake_channel, gen, min_seq]
        for g in groups:
            keys += [shard.due(g.rule), shard.dead(g.rule)]
            window = f"{g.window_ms}|{shard.quiet_prefix}" if g.leading else g.window_ms
            args += [window, g.max_wait_ms, len(g.keys), KEY_SEPARATOR.join(g.keys),
                     1 if g.held else 0, _upsert_times(g)]
        items = _upsert_items(groups)
        if items or any(g.schedules for g in groups):  # a schedule drops the old items
            args += [shard.items_prefix, *items]
        result = await self._run("upsert", keys, args)
        if int(result[0]) == 0:
            raise LayoutMovedError(shard.shard, int(result[1]))
        failed = result[3] if len(result) > 3 else []
        return UpsertResult(int(result[1]),
                            {str(failed[i]): str(failed[i + 1]) for i in range(0, len(failed), 2)},
                            tuple(str(k) for k in result[4]) if len(result) > 4 else (),
                            int(result[5]) if len(result) > 5 else 0,
                            tuple(str(b) for b in result[6]) if len(result) > 6 else ())

    async def cancel(self, shard: ShardKeys, groups: Sequence[CancelGroup],
                     history: History = NO_HISTORY) -> CancelAnswer:
        """Drop the groups' keys' pending refreshes (and the re-arms of running ones):
        each key with the state it was found in, and the keys in transit."""
        keys = [shard.meta, shard.history, shard.moving, shard.seq]
        args: list[Any] = [history.node_id, history.length, shard.items_prefix,
                           shard.claimed_prefix, shard.traces_prefix]
        for g in groups:
            keys.append(shard.due(g.rule))
            args += [g.rule, len(g.keys), KEY_SEPARATOR.join(g.keys)]
        args.append(shard.quiet_prefix)
        _, found, seq, transit = await self._run("cancel", keys, args)
        names = [k for g in groups for k in g.keys]
        states = [str(s) for s in found]
        if len(states) != len(names) or not set(states) <= set(CANCEL_STATES):
            raise ScriptError(f"cancel answered {found!r} for {plural(len(names), 'key')}")
        return CancelAnswer(dict(zip(names, states, strict=True)), int(seq),
                            tuple(str(b) for b in transit))

    async def limits(self, shard: ShardKeys, rules: Sequence[str], *, keep_dead: int,
                     dead_ttl_ms: int, budget: int) -> LimitsAnswer:
        """Count the shard's pending keys; drop its dead letters older than
        ``dead_ttl_ms``, then its oldest past ``keep_dead`` (at most ``budget``)."""
        keys = [shard.meta, *(shard.due(r) for r in rules), *(shard.dead(r) for r in rules)]
        args = [len(rules), shard.items_prefix, shard.claimed_prefix, keep_dead, dead_ttl_ms,
                budget, shard.traces_prefix]
        found = await self._run("limits", keys, args)
        return LimitsAnswer(*(int(n) for n in found))

    async def traces_put(self, shard: ShardKeys, values: Mapping[str, str], keep: int,
                         grace_ms: int) -> int:
        """Keep trace contexts beside their keys (``values``: key -> the form
        traces_put.lua merges), at most ``keep`` at each end of a burst, only for keys
        that have a state; they expire ``grace_ms`` after the key's due time. Returns how
        many keys got theirs."""
        if not values:
            return 0
        args: list[Any] = [keep, grace_ms]
        for key, value in values.items():
            args += [key, value]
        return int(await self._run("traces_put",
                                   [shard.meta, *(shard.traces(k) for k in values)], args))

    async def traces_take(self, shard: ShardKeys, keys: Sequence[str]) -> list[str | None]:
        """The trace contexts kept for ``keys`` (None where none), deleted."""
        if not keys:
            return []
        found = await self._run("traces_take", [shard.traces(k) for k in keys], [])
        return [str(v) if v else None for v in found]
