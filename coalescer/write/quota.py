"""The rules file's ``limits:`` at work: touches refused past ``pending_keys`` or
``pending_bytes``, and dead letters dropped past their count or age.

Every ``EVERY`` seconds (every shard count / ``SHARDS_PER_SECOND`` seconds with many
shards) while this node takes touches (and a few seconds after, and while it refuses
them), else every ``IDLE_EVERY`` seconds, a node runs limits.lua on every shard (counts
its pending keys, drops its dead letters past their age, then past its share of
``dead_letters``, the count divided by the shards, rounded up) and pending_bytes.lua
(store/byte_count.py). What is refused, and why the count may pass the limit by what
every node writes within one period: docs/rules.md, "Limits".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.common.retrying import keep_running
from coalescer.config.durations import format_duration
from coalescer.config.rules import Config
from coalescer.config.sizes import format_size
from coalescer.errors import QuotaExceededError
from coalescer.store.byte_count import ByteCount
from coalescer.store.keys import KeySpace
from coalescer.store.script_types import LimitsAnswer
from coalescer.store.scripts import Scripts

log = logging.getLogger(__name__)

EVERY = 1.0  # seconds between two counts (and dead-letter trims) while touches come
IDLE_EVERY = 60.0  # seconds between two of them on a node that takes no touches
AFTER_TOUCHES = 3  # counts made after the last touch (its write lands meanwhile)
SHARDS_PER_SECOND = 256  # script calls a count makes a second at most: many shards count
# less often (2,048 shards: every 8 s), so that counting never costs Redis much
DROP_BUDGET = 1000  # dead letters one shard drops at most per call


class Quota:
    """This node's view of the pending keys, and the dead-letter trimming."""

    def __init__(self, config: Config, scripts: Scripts, keyspace: Callable[[], KeySpace],
                 metrics: Metrics, activity: Callable[[], int]) -> None:
        """``activity()``: a number that grows with every touch this node takes."""
        self._limits = config.limits
        self._rules = [rule.name for rule in config.rules]
        self._scripts = scripts
        self._keyspace = keyspace
        self._metrics = metrics
        self._activity = activity
        self._every = EVERY
        self._seen = activity()  # at the last look
        self._more = 0  # counts still to make after the last touch (its write lands)
        self._idle_for = 0.0  # seconds since the last count, while idle
        self.pending: int | None = None  # None: not counted yet
        self.bytes: int | None = None  # None: not counted yet
        self._bytes = ByteCount(scripts.client,
                                items=any(rule.items is not None for rule in config.rules),
                                leading=any(rule.leading for rule in config.rules))

    def check(self) -> None:
        """QuotaExceededError when the last count reached ``pending_keys`` or
        ``pending_bytes``."""
        limit = self._limits.pending_keys
        if self.pending is None or self.pending < limit:
            self._check_bytes()
            return
        self._metrics.quota_refusals.inc()
        raise QuotaExceededError(
            f"touch refused: {self.pending} keys are waiting for their refresh, at or over "
            f"limits.pending_keys ({limit}); nothing was touched, try again in "
            f"{self._every:g} s", limit="pending_keys", value=limit, retry_after=self._every)

    def _refusing(self) -> bool:
        """Whether the last count reached a limit (touches are refused until one does
        not)."""
        limits = self._limits
        return ((self.pending is not None and self.pending >= limits.pending_keys)
                or (self.bytes is not None and self.bytes >= limits.pending_bytes))

    def _check_bytes(self) -> None:
        size = self._limits.pending_bytes
        if self.bytes is None or self.bytes < size:
            return
        self._metrics.quota_refusals.inc()
        raise QuotaExceededError(
            f"touch refused: the keys waiting for their refresh hold {format_size(self.bytes)}"
            f" of Redis ({self.bytes} bytes: names, items, schedules, trace contexts), at or "
            f"over limits.pending_bytes ({format_size(size)}); nothing was touched, try "
            f"again in {self._every:g} s", limit="pending_bytes", value=size,
            retry_after=self._every)

    async def run(self) -> None:
        await keep_running("limits: counting pending keys, dropping old dead letters",
                           self._maybe_step, logger=log, rest=self._rest)

    async def _rest(self) -> None:
        await asyncio.sleep(self._every)

    async def _maybe_step(self) -> None:
        """A count in the few seconds after touches came, while touches are refused,
        and once every ``IDLE_EVERY`` on an idle node."""
        activity = self._activity()
        if activity != self._seen:
            self._seen, self._more = activity, AFTER_TOUCHES
        refusing = self._refusing()
        if not (self._more or refusing or self._idle_for >= IDLE_EVERY):
            self._idle_for += self._every
            return
        count_bytes = bool(self._more) or refusing  # an idle node's look costs no more
        self._more, self._idle_for = max(0, self._more - 1), 0.0
        await self.step(count_bytes=count_bytes)

    async def step(self, *, count_bytes: bool = True) -> None:
        """Count every shard's pending keys (and, with ``count_bytes``, read on through
        its bytes), trim its dead letters; log what was dropped."""
        space, limits = self._keyspace(), self._limits
        self._every = max(EVERY, space.span / SHARDS_PER_SECOND)
        keep = limits.dead_letters_per_shard(space.shards)
        answers = await asyncio.gather(*(
            self._scripts.limits(shard, self._rules, keep_dead=keep,
                                 dead_ttl_ms=round(limits.dead_letter_ttl * 1000),
                                 budget=DROP_BUDGET)
            for shard in space.all_shards()))
        self.pending = sum(a.pending for a in answers)
        self._report(answers, keep)  # what was dropped, as soon as Redis did it
        if count_bytes:
            self.bytes = await self._bytes.count_all(space.all_shards())

    def _report(self, answers: list[LimitsAnswer], keep: int) -> None:
        by_age = sum(a.dropped_by_age for a in answers)
        by_count = sum(a.dropped_by_count for a in answers)
        if by_age:
            self._metrics.dead_letters_dropped.labels("age").inc(by_age)
        if by_count:
            self._metrics.dead_letters_dropped.labels("count").inc(by_count)
        if by_age or by_count:
            log.warning("dead letters dropped: %d older than limits.dead_letter_ttl (%s), "
                        "%d oldest past limits.dead_letters (%s a shard); %s kept",
                        by_age, format_duration(self._limits.dead_letter_ttl), by_count,
                        keep, plural(sum(a.dead for a in answers), "dead letter"))
