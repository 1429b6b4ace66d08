"""Bulk cancel of scheduled keys: every pending key of a rule whose own time (``at`` /
``delay``) lies after a given time, shard by shard, a page per script call.

Each call looks at ``PAGE`` keys of one shard's due set at most (``ZRANGEBYSCORE ...
LIMIT``, store/lua/cancel_scheduled.lua), so no call blocks Redis for long however many
keys there are; the calls of one shard follow each other until its keys after the time
are all looked at. Keys of the rule that are pending without a time of their own (a
plain burst) are kept, and so is a running key (its refresh goes on; a schedule it
collected for its next run is cancelled by key, ``coalescer cancel KEY``). A key
touched again while the cancel runs may be cancelled or kept, as with a cancel by key.
While a reshard runs, the keys still in transit are not looked at: run it again after.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from coalescer.common.audit_log import AuditSink, operator_action
from coalescer.common.printable import printable
from coalescer.config.rules import Config
from coalescer.config.schedule import At, at_ms
from coalescer.store.keys import KeySpace
from coalescer.store.script_types import BulkCancel
from coalescer.store.scripts import Scripts

PAGE = 1000  # keys looked at per script call: about a millisecond of Redis time


def bulk_cancel(config: Config, rule: str, after: At, node_id: str,
                dry_run: bool = False) -> BulkCancel:
    """The bulk cancel of the keys of ``rule`` scheduled after ``after`` (an aware
    datetime, epoch seconds or ISO-8601 text). KeyError for a rule ``config`` lacks,
    InvalidScheduleError for a time that cannot be read."""
    if rule not in {r.name for r in config.rules}:
        raise KeyError(rule)
    after_ms = at_ms(f"(rule {rule}, scheduled after)", after, math.inf)
    return BulkCancel(rule=rule, after_ms=after_ms, node=node_id,
                      history_length=config.history, dry_run=dry_run)


async def cancel_rule_scheduled(scripts: Scripts, space: KeySpace, bulk: BulkCancel,
                                who: str, sink: AuditSink | None = None) -> int:
    """Cancel (count, in a dry run) the keys of ``bulk``; how many. Logs the action
    (``who`` did it) at INFO, and writes it to ``sink`` (the audit log)."""
    done = await cancel_scheduled(scripts, space, bulk)
    if not bulk.dry_run:
        after = datetime.fromtimestamp(bulk.after_ms / 1000, UTC).isoformat()
        operator_action("cancel", f"the keys of rule {printable(bulk.rule)} scheduled "
                        f"after {after}", done, who, sink=sink)
    return done


async def cancel_scheduled(scripts: Scripts, space: KeySpace, bulk: BulkCancel,
                           page: int = PAGE) -> int:
    """Cancel (or count) the keys of ``bulk`` in every shard of ``space``; how many."""
    total = 0
    for shard in space.all_shards():
        offset = 0
        while True:
            done = await scripts.cancel_scheduled(shard, bulk, offset, page)
            total += done.cancelled
            offset += done.kept
            if done.examined < page:
                break
    return total
