"""The claim protocol's Python side: the per-call limits and ``claim_into_slots``, the one
way a claim call's grants enter a process's handler slots (the slot bookkeeping itself
is the runner's).

A key's life in Redis (due, claimed with a fencing token and a claim lease, renewed,
acked or failed, recovered once its holder stops renewing) is told in docs/concepts.md
("Poller", "Runner", "Recovery") and in each script's header (``claim_due`` in
``store/lua/_lib.lua``; ``claim.lua``, ``adopt.lua``, ``take.lua``, ``renew.lua``,
``ack.lua``, ``fail.lua``, ``recover.lua``). Their typed wrappers are methods of
``store.scripts.Scripts``, which builds the result types named here for the worker.
A rule's items travel with its claims only when a rule of the call has items
(``item_rules``): other rules pay nothing.
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
