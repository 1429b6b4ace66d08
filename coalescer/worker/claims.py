"""The claim protocol: how a due key becomes one exclusive run of its refresh.

A key's life in Redis, per shard and rule (``due:RULE`` and ``inflight:RULE``):

* **due** — pending in ``due:RULE``, scored by its due time (the window after its
  last touch, capped by the max wait, or a retry's backoff).
* **claimed** — moved to ``inflight:RULE`` by the ``claim_due`` function of
  ``store/lua/_lib.lua``, which every claiming script shares: due keys only, lowest
  first, each with a **fencing token** from the shard's counter (it grows with every
  claim, so a stale holder can be told apart) and a **claim lease** (its score in
  the in-flight set), with the claiming node kept in the claim. Three scripts call
  it: ``claim.lua`` (the shard's leader, checking and renewing its leader lease in
  the same script, so an ex-leader can never claim), ``adopt.lua`` (during a rolling
  deploy, the one live node that knows a rule the leader lacks claims its keys) and
  ``take.lua`` (a drain: claims for its own process, whoever leads the shard).
* **renewed** — every third of the claim lease the holder extends the leases of
  what it runs (``renew.lua``, only for the holder of the token); a claim it no
  longer holds is cancelled here, and a holder cut off from Redis stops its
  refreshes before the lease can lapse.
* **acked** or **failed** — the result is recorded by the holder of the token only
  (``ack.lua``, ``fail.lua``): a success finishes the claim, a failure is retried
  after its backoff or dead-lettered after the last attempt; a key touched while
  it ran goes back to due. A result carrying an older token is refused as stale.
* **items** — for a rule with ``items:`` each claiming script also moves the key's
  pending items into its claimed set and returns them with the claim (``ClaimedKey.items``,
  ``overflowed``); a success ack deletes that set, a failure and a recovery keep it for
  the next claim. The scripts get an items section only when a rule of the call has
  items (``item_rules``): other rules pay nothing.
* **recovered** — a claim whose holder stopped renewing it goes back to due with its
  attempt counted (``recover.lua``). The leader and an adopter judge that by their own
  clock (``worker.lapsed``: the lease score unchanged for a full lease as they measure
  time, so a step of the server's clock expires nothing early); a drain (a test
  process) by the server's clock.

The scripts are registered once, with typed wrappers, as methods of
``store.scripts.Scripts``: ``claim``, ``adopt``, ``take``, ``renew``, ``ack``,
``fail`` and ``recover``. Their result types (``ClaimedKey``, ``ClaimBatch``,
``AdoptBatch``, ``Failure``, ``AckItem``) are built there, where the replies are
decoded, and are named here for the worker. This module holds the rest of the
Python side: the per-call limits and ``claim_into_slots``, the
one way a claim call's grants enter a process's handler slots (the slot
bookkeeping itself is the runner's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

from coalescer.config.rules import Rule
from coalescer.store.script_types import AckItem, AdoptBatch, ClaimBatch, ClaimedKey, Failure
from coalescer.worker.lease_clock import ServerClock

__all__ = ["MAX_CLAIM", "RECOVER_BATCH", "AckItem", "AdoptBatch", "ClaimBatch", "ClaimedKey",
           "Failure", "Taken", "claim_into_slots", "item_rules"]

log = logging.getLogger(__name__)

MAX_CLAIM = 1000  # keys per rule per claim call: each script call stays short
RECOVER_BATCH = 500  # expired claims per rule re-queued by one recover call


def item_rules(rules: Iterable[Rule]) -> dict[str, int]:
    """The rules with ``items:``, each with its items max: what the claiming scripts and
    ack need to move and drop their items (rules without items cost nothing there)."""
    return {rule.name: rule.items.max for rule in rules if rule.items is not None}


class Taken(NamedTuple):
    """What a take call (a drain's claim) returned: the server's clock and the claims."""

    now_ms: int
    claims: list[ClaimedKey]


class Granted(Protocol):
    """A claim call's answer: the server's clock when it ran, and the claims granted."""

    @property
    def now_ms(self) -> int: ...

    @property
    def claims(self) -> Sequence[ClaimedKey]: ...


Answer = TypeVar("Answer", bound=Granted)


class Slots(Protocol):
    """The handler slots claims are started in (the runner)."""

    def reserve(self, rule: Rule, most: int, *, queue: bool = True) -> int: ...

    def unreserve(self, rule: Rule, n: int) -> None: ...

    def start_all(self, shard: int, rules: Sequence[Rule], claims: Sequence[ClaimedKey],
                  clock_offset_ms: float, *, taken: list[int], sent: float) -> None: ...


async def claim_into_slots(
    slots: Slots, shard: int, rules: Sequence[Rule], most: int,
    call: Callable[[list[tuple[str, int]]], Awaitable[Answer]], *, queue: bool = True,
    clock: ServerClock | None = None,
) -> tuple[Answer, list[int], list[int]]:
    """Reserve up to ``most`` free slots per rule, make the claim ``call`` with those
    limits, start what it granted and give back the slots left unused.

    Returns the answer, the limit each rule was given and how many keys it took.
    Reserving before the call keeps pollers of several shards from filling the
    same free slots; ``queue=False`` reserves only slots a claim runs in at once.
    The server's clock offset (the answer's ``now_ms`` against the middle of the
    call) goes with each claim, and so does when the call was sent (monotonic clock):
    the claims' leases began after it. ``clock`` observes the server's clock.
    """
    limits = [slots.reserve(r, most, queue=queue) for r in rules]
    taken = [0] * len(rules)
    try:
        sent, sent_wall = time.monotonic(), time.time() * 1000
        answer = await call([(r.name, n) for r, n in zip(rules, limits, strict=True)])
        got = time.monotonic()
        if clock is not None:
            clock.observe(sent, got, answer.now_ms)
        offset = answer.now_ms - (sent_wall + time.time() * 1000) / 2
        slots.start_all(shard, rules, answer.claims, offset, taken=taken, sent=sent)
    finally:
        for rule, n, t in zip(rules, limits, taken, strict=True):
            slots.unreserve(rule, n - t)
    return answer, limits, taken
