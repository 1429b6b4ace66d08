"""The scripts of bulk actions on scheduled keys, registered once on a client and wrapped
by small typed functions (beside ``store/scripts.py``, which holds the rest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import script_source


@dataclass(frozen=True, kw_only=True, slots=True)
class BulkCancel:
    """A bulk cancel: the keys of ``rule`` scheduled after ``after_ms`` (epoch ms);
    ``node`` is who the history names; ``history_length`` 0 records nothing; with
    ``dry_run`` they are only counted."""

    rule: str
    after_ms: int
    node: str
    history_length: int
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class CancelPage:
    """What one page of a bulk cancel did: keys cancelled (or counted, in a dry run),
    keys looked at, keys kept (the next page skips them)."""

    cancelled: int
    examined: int
    kept: int


class ScheduleScripts:
    """cancel_scheduled.lua on one Redis (or Redis Cluster) client."""

    def __init__(self, redis: Any) -> None:
        self._cancel = redis.register_script(script_source("cancel_scheduled"))

    async def cancel_scheduled(self, shard: ShardKeys, bulk: BulkCancel, offset: int,
                               page: int) -> CancelPage:
        """One page of ``bulk`` in ``shard``: at most ``page`` keys looked at, after the
        ``offset`` kept by the pages before (see cancel_scheduled.lua)."""
        keys = [shard.meta, shard.due(bulk.rule), shard.history]
        args = [bulk.after_ms, offset, page, shard.items_prefix, shard.claimed_prefix,
                shard.traces(""), bulk.rule, bulk.node, bulk.history_length,
                1 if bulk.dry_run else 0]
        cancelled, examined, kept = await self._cancel(keys=keys, args=args)
        return CancelPage(int(cancelled), int(examined), int(kept))
