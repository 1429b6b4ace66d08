"""Claims whose holder stopped renewing them, found by the claimer's own clock.

A leader (or an adopter) re-queues a claim of its shard only once it has seen the
claim's lease score unchanged for a full ``claim_lease`` as this node measures time
(``lease_clock``): a holder renews every quarter lease, each renewal writing a new
score, so a holder that is alive keeps its claim whatever the server's clock does.

The server's clock says where to look: a claim call reports the earliest lease score
(``next_expiry_ms``), and only scores the server already counts as ended are read (one
pipelined read), so a healthy shard costs nothing more. Every held claim is read instead
on the first look of a term of claiming, for two leases after the server's clock was
seen to step, and while suspects remain: a backward step leaves a dead holder's score in
the future, further ahead than any renewal sets it, and such a claim is taken over one
lease after its score was first read. The re-queue (``recover.lua``) lists each claim
with the score read, and re-queues it only while that score is still there. """

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from coalescer.config.rules import Rule
from coalescer.store.keys import ShardKeys
from coalescer.store.scripts import Scripts
from coalescer.worker.lease_clock import ServerClock, Sightings

log = logging.getLogger(__name__)

READ_LIMIT = 1000  # claims per rule read by one look
RECOVER_LIMIT = 500  # claims per rule re-queued by one call
STEP_WATCH = 2.0  # leases after a step of the server's clock during which every claim is read


class LapsedClaims:
    """Finds and re-queues the lapsed claims of some rules of one shard."""

    def __init__(self, scripts: Scripts, shard: ShardKeys, clock: ServerClock,
                 claim_lease: float) -> None:
        self._scripts = scripts
        self._shard = shard
        self._clock = clock
        self._lease = claim_lease
        self._lease_ms = round(claim_lease * 1000)
        self._seen: Sightings[tuple[int, str]] = Sightings()  # the suspects
        self._fresh = True

    def restart(self) -> None:
        """A new term of claiming (leadership won, or adoption begun): the first look reads
        every claim held, whatever the server's clock says of them (the rules may differ
        from the last term's: nothing seen then is kept)."""
        self._fresh = True
        self._seen.clear()

    async def check(self, rules: Sequence[Rule], now_ms: int,
                    next_expiry_ms: int | None) -> tuple[bool, float | None]:
        """Re-queue what lapsed; returns whether some was, and in how many seconds the
        next claim read could have lapsed (None: nothing to wait for)."""
        now = time.monotonic()
        every = (self._fresh or len(self._seen) > 0
                 or self._clock.stepped_within(self._lease * STEP_WATCH, now))
        self._fresh = False
        if next_expiry_ms is None or (next_expiry_ms > now_ms and not every):
            self._seen.clear()
            return False, None
        names = [r.name for r in rules]
        read = await self._scripts.lease_scores(self._shard, names, READ_LIMIT,
                                                None if every else now_ms)
        lapsed, wait = self._judge(read, now_ms, time.monotonic())
        if not any(lapsed):
            return False, wait
        n = await self._scripts.recover(self._shard, names, RECOVER_LIMIT,
                                        [r.retry.attempts for r in rules], lapsed)
        if n:
            log.warning("shard %d: %d claims whose holder stopped renewing were re-queued",
                        self._shard.shard, n)
        return n > 0, wait

    def _judge(self, read: list[dict[str, int]], now_ms: int,
               now: float) -> tuple[list[list[tuple[str, int]]], float | None]:
        """The claims read that lapsed (per rule, with their score), and the seconds until
        the next suspect could. A suspect is a claim whose score the server's clock says
        ended, or one further ahead than a renewal can set (only a backward step of the
        server's clock makes that): only suspects are remembered and looked at again."""
        suspects = {(i, key): score for i, found in enumerate(read)
                    for key, score in found.items()
                    if score <= now_ms or score > now_ms + self._lease_ms}
        first = self._seen.see(suspects, now)
        lapsed: list[list[tuple[str, int]]] = [[] for _ in read]
        wait: float | None = None
        grace = self._lease + self._clock.margin()
        for (i, key), seen in first.items():
            score = suspects[i, key]
            ends = self._clock.renewed_at(score - self._lease_ms, seen) + grace
            if ends > now:
                wait = ends - now if wait is None else min(wait, ends - now)
            elif len(lapsed[i]) < RECOVER_LIMIT:
                lapsed[i].append((key, score))
        return lapsed, wait


def expiry_delay(now_ms: int, next_expiry_ms: int | None, lapse_wait: float | None,
                 cap: float) -> float | None:
    """Seconds until a claimer looks at held claims again: just past the earliest lease
    score (at most ``cap`` once the server's clock passed it), or sooner when the last
    look said a claim could have lapsed by then (``lapse_wait``). None: none is held."""
    if next_expiry_ms is None:
        return None
    delay = (next_expiry_ms - now_ms) / 1000 + 0.0005 if next_expiry_ms > now_ms else cap
    return delay if lapse_wait is None else max(0.001, min(delay, lapse_wait))
