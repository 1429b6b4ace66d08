"""A worker node's view of the rules an operator paused (cluster-wide, in Redis): when it
reads the paused set (``store.keys.paused_rules``) and what a paused rule costs are
docs/operations.md's "Operator controls". A read that fails is made again a second
later. The pollers and adopters pass a paused rule's limit as -1 to their claim
scripts; the scripts also read the shard's own copy of the set (``store.paused_copies``),
so a node that has not heard of a pause yet claims none of those keys either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from coalescer.common.metrics import Metrics
from coalescer.store import keys as key_names
from coalescer.worker.wakeups import SUBSCRIBED

log = logging.getLogger(__name__)

PAUSED_LIMIT = -1  # a claim script's limit for a paused rule (claim.lua, adopt.lua)
RETRY_DELAY = 1.0  # seconds before a failed read of the paused rules is made again


class PausedRules:
    """The rules paused now, as this node last read them."""

    def __init__(self, redis: Any, namespace: str, rules: Sequence[str], metrics: Metrics,
                 on_change: Callable[[], None]) -> None:
        self._redis = redis
        self._key = key_names.paused_rules(namespace)
        self.channel = key_names.paused_channel(namespace)
        self._rules = tuple(rules)
        self._metrics = metrics
        self._on_change = on_change
        self.names: frozenset[str] = frozenset(self._rules)  # all, until the first read
        self.read_once = False
        self._reading: asyncio.Future[None] | None = None
        self._again = False
        self._poke = False  # an announcement came: poke the pollers after the read

    def limits(self, limits: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``limits`` with each paused rule's set to PAUSED_LIMIT."""
        if not self.names:
            return limits
        return [(rule, PAUSED_LIMIT if rule in self.names else n) for rule, n in limits]

    def announced(self, message: Any) -> None:
        """A pause or resume was announced (or the subscription confirmed): read again,
        once at a time (a read running now may predate the change: read once more).
        After an announcement the pollers are poked even if this node's view did not
        change: the claim scripts hold a pause this node never saw, and its resume must
        still wake the pollers that left those keys aside."""
        self._again = True
        self._poke = self._poke or message != SUBSCRIBED
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_all())

    async def _read_all(self) -> None:
        while self._again:
            self._again = False
            if not await self._read():
                self._again = True  # a change may be missed, or none read yet: again
                await asyncio.sleep(RETRY_DELAY)

    def close(self) -> None:
        """Stop reading (the node stops)."""
        if self._reading is not None:
            self._reading.cancel()

    async def _read(self) -> bool:
        try:
            found = frozenset(str(n) for n in await self._redis.smembers(self._key))
        except (RedisError, OSError) as exc:
            log.warning("reading the paused rules failed: %r (read again in %gs)", exc,
                        RETRY_DELAY)
            return False
        changed = found != self.names or not self.read_once
        self.names, self.read_once = found, True
        for rule in self._rules:
            self._metrics.rule_paused.labels(rule).set(1 if rule in found else 0)
        if changed and found:
            log.info("paused rules: %s", ", ".join(sorted(found)))
        if changed or self._poke:
            self._poke = False
            self._on_change()
        return True


def paused_limits(paused: PausedRules | None,
                  limits: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``limits`` with each paused rule's set to PAUSED_LIMIT (none paused: as given)."""
    return limits if paused is None else paused.limits(limits)
