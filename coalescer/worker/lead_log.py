"""One log line for the shards a node leads, not one per shard.

With thousands of shards, a line per shard on every election, hand-back, lost
lease or failed round floods the log. Each shard's ``Leadership`` reports here
instead; ``tick()`` (about once a second) logs "NODE leads N of M shards" once
the set of led shards has stopped changing (or at least every ``MAX_QUIET``
seconds while it keeps changing), and one warning per tick naming how many
shards lost their lease or started failing.
"""

from __future__ import annotations

import logging
import time

from coalescer.common.plural import plural

log = logging.getLogger(__name__)

MAX_QUIET = 10.0  # seconds a changing set goes unlogged at most


class LeadLog:
    """Summarises the leadership of one node's shards."""

    def __init__(self, node_id: str, total: int, led: set[int]) -> None:
        self._node_id = node_id
        self.total = total
        self.led = led  # the shards the node leads now, shared with its leaderships
        self.asking: set[int] = set()  # the shards whose acquire call is in flight
        self._logged: frozenset[int] = frozenset()
        self._seen: frozenset[int] = frozenset()
        self._changed_at: float | None = None
        self._lost = 0
        self._failing = 0
        self._error: BaseException | None = None

    def lost(self) -> None:
        """A shard's lease was found gone (another node took it, or it expired)."""
        self._lost += 1

    def failing(self, error: BaseException) -> None:
        """A shard's leadership round began to fail (logged once per run of failures)."""
        self._failing += 1
        self._error = error

    def tick(self, *, final: bool = False) -> None:
        """Log what changed since the last line; ``final`` logs the set as it is now."""
        self._warn()
        now = frozenset(self.led)
        if now == self._logged:
            self._changed_at = None
        elif final or self._settled(now):
            self._summarise(now)
        self._seen = now

    def _settled(self, now: frozenset[int]) -> bool:
        clock = time.monotonic()
        if self._changed_at is None:
            self._changed_at = clock
        return now == self._seen or clock - self._changed_at >= MAX_QUIET

    def _summarise(self, now: frozenset[int]) -> None:
        log.info("%s leads %d of %s (+%d, -%d)", self._node_id, len(now),
                 plural(self.total, "shard"),
                 len(now - self._logged), len(self._logged - now))
        self._logged = now
        self._changed_at = None

    def _warn(self) -> None:
        if self._lost:
            log.warning("%s lost the leader lease of %s; stopped claiming there",
                        self._node_id, plural(self._lost, "shard"))
            self._lost = 0
        if self._failing:
            log.warning("leadership rounds of %s failed, will retry: %r",
                        plural(self._failing, "shard"), self._error)
            self._failing = 0
            self._error = None
