"""Whether a Kafka source is stalled: what /healthz and ``coalescer status`` say of it.

A source is stalled when, for longer than its ``stalled_after``, no node of the
deployment holds a partition of its topics (the topics do not exist or have none, or
the group never assigns: a broker that is reachable but a group that never works), or
when this node holds partitions with messages waiting and commits nothing. One node
with no partition while others hold them (more nodes than partitions) is not stalled:
the others' reports in Redis (``sources_kafka``) say so.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from coalescer.config.durations import format_duration
from coalescer.config.kafka_source import KafkaSource
from coalescer.sources.kafka_status import REPORT_STALE

log = logging.getLogger("coalescer.sources.kafka")

LOOK_EVERY = 1.0  # seconds between two reads of the other nodes' reports, at most

# partition -> (committed, end offset, lag), as KafkaLoop.lags() gives them
Lags = Mapping[Any, tuple[int, int | None, int | None]]


class StallWatch:
    """Follows one source on one node; ``problem`` is why it is stalled, or None."""

    def __init__(self, source: KafkaSource, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._source = source
        self._clock = clock
        self._held_at = clock()  # when some node last held a partition (or the start)
        self._moved_at = clock()  # when this node last committed, or had nothing waiting
        self._committed: dict[Any, int] = {}
        self._looked = 0.0
        self.problem: str | None = None

    def restart(self) -> None:
        """Count from now (the broker could not be reached: that is said already)."""
        self._held_at = self._moved_at = self._clock()

    async def look(self, redis: Any, reports_key: str, owned: bool, lags: Lags) -> None:
        """Update ``problem`` from what this node holds and, when it holds nothing,
        from the other nodes' reports of their partitions."""
        now = self._clock()
        if owned:
            self._held_at = now
            self._set(self._not_reading(now, lags))
            return
        self._committed, self._moved_at = {}, now
        if now - self._held_at <= self._source.stalled_after:
            self._set(None)
            return
        if now - self._looked < LOOK_EVERY:
            return
        self._looked = now
        if await self._others_hold(redis, reports_key):
            self._held_at = now
            self._set(None)
            return
        self._set(f"no node has held a partition of {', '.join(self._source.topics)} in "
                  f"group {self._source.group!r} for over "
                  f"{format_duration(self._source.stalled_after)} (do the topics exist, "
                  "with partitions?)")

    def _not_reading(self, now: float, lags: Lags) -> str | None:
        committed = {tp: entry[0] for tp, entry in lags.items()}
        waiting = sum(entry[2] or 0 for entry in lags.values())
        if not waiting or committed != self._committed:
            self._moved_at = now
        self._committed = committed
        if now - self._moved_at <= self._source.stalled_after:
            return None
        return (f"read nothing for over {format_duration(self._source.stalled_after)} "
                "while messages wait")

    async def _others_hold(self, redis: Any, reports_key: str) -> bool:
        """Whether a live node reported a partition of this source lately."""
        found = await redis.hgetall(reports_key)
        now_ms = time.time() * 1000
        prefix = f"{self._source.name}|".encode()
        for field, raw in found.items():
            name = field if isinstance(field, bytes) else str(field).encode()
            if not name.startswith(prefix) or name[len(prefix):].startswith(b"node|"):
                continue
            try:
                if now_ms - json.loads(raw)["at_ms"] <= REPORT_STALE * 1000:
                    return True
            except (ValueError, KeyError, TypeError):
                continue
        return False

    def _set(self, problem: str | None) -> None:
        if problem == self.problem:
            return
        if problem is not None:
            log.warning("source %s: %s", self._source.name, problem)
        elif self.problem is not None:
            log.info("source %s: reading again", self._source.name)
        self.problem = problem
