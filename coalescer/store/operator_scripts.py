"""An operator's script wrappers: dead letters brought back or purged, pending keys
made due now (all of a rule's, or one key), a rule's keys scheduled after a time
cancelled."""

from __future__ import annotations

from collections.abc import Sequence

from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import ScriptCalls
from coalescer.store.script_types import BulkCancel, CancelPage, Hastened


class OperatorScripts(ScriptCalls):
    """What an operator asks of a shard's keys."""

    async def requeue(self, shard: ShardKeys, rule: str, dead_keys: Sequence[str]) -> int:
        """Bring dead-lettered keys of ``rule`` back; returns how many."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        result = await self._run("requeue", keys, [shard.wake_channel, *dead_keys])
        return int(result[0])

    async def requeue_each(self, shard: ShardKeys, rule: str, dead_keys: Sequence[str],
                           *, wake: bool = True) -> tuple[int, list[str]]:
        """Bring dead-lettered keys of ``rule`` back: (how many, the keys that were not dead).
        ``wake`` False leaves the shard's poller asleep (a later call of the same batch
        wakes it)."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        channel = shard.wake_channel if wake else ""
        result = await self._run("requeue", keys, [channel, *dead_keys])
        return int(result[0]), [str(k) for k in result[1:]]

    async def requeue_first(self, shard: ShardKeys, rule: str, start: int, count: int,
                            *, wake: bool = True) -> tuple[int, int]:
        """Bring back the dead keys at ranks ``start`` to ``start + count - 1`` of
        ``rule``'s dead set: (how many came back, entries read). The entries that did not
        come back stay at the ranks from ``start``; ``wake`` False leaves the poller asleep."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        channel = shard.wake_channel if wake else ""
        back, read = await self._run("requeue_first", keys, [channel, start, count])
        return int(back), int(read)

    async def purge(self, shard: ShardKeys, rule: str,
                    dead_keys: Sequence[str]) -> tuple[int, list[str]]:
        """Delete dead-lettered keys of ``rule``: (how many, the keys that were not dead)."""
        markers = [shard.quiet(key) for key in dead_keys]
        result = await self._run("purge", [shard.meta, shard.dead(rule), *markers],
                                 [shard.items_prefix, shard.claimed_prefix,
                                  shard.traces_prefix, *dead_keys])
        return int(result[0]), [str(k) for k in result[1:]]

    async def hasten(self, shard: ShardKeys, rules: Sequence[str], limit: int) -> Hastened:
        """Make up to ``limit`` pending keys of each rule due now; counts what is left."""
        keys = [shard.meta]
        for rule in rules:
            keys += [shard.due(rule), shard.inflight(rule)]
        now, hastened, pending, in_flight = await self._run("hasten", keys, [limit])
        return Hastened(int(now), int(hastened), int(pending), int(in_flight))

    async def run_now(self, shard: ShardKeys, rule: str, key: str) -> str:
        """Make pending ``key`` due now and wake the shard's poller; what it found (see
        run_now.lua: "hastened" or "due" run next)."""
        _now, state = await self._run("run_now", [shard.meta, shard.due(rule), shard.next_wake],
                                      [key, shard.wake_channel])
        return str(state)

    async def cancel_scheduled(self, shard: ShardKeys, bulk: BulkCancel, offset: int,
                               page: int) -> CancelPage:
        """One page of ``bulk`` in ``shard``: at most ``page`` keys looked at, after the
        ``offset`` kept by the pages before (see cancel_scheduled.lua)."""
        keys = [shard.meta, shard.due(bulk.rule), shard.history]
        args = [bulk.after_ms, offset, page, shard.items_prefix, shard.claimed_prefix,
                shard.traces(""), bulk.rule, bulk.node, bulk.history_length,
                1 if bulk.dry_run else 0]
        cancelled, examined, kept = await self._run("cancel_scheduled", keys, args)
        return CancelPage(int(cancelled), int(examined), int(kept))
