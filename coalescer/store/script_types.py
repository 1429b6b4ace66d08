"""What the script wrappers take and answer: the groups of keys a call writes, the
claims and leases it grants, the counts it found. Plain values, no Redis."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from coalescer.store.keys import ShardKeys

OVERFLOW = ""  # the member of a key's items set that says its items overflowed (_lib.lua)


@dataclass(frozen=True, slots=True)
class UpsertGroup:
    """Keys of one rule to schedule: the rule's window and max wait in ms."""

    rule: str
    window_ms: int
    max_wait_ms: int
    keys: Sequence[str]
    # key -> the items touched with it ("" for an overflow), for some of ``keys``; a
    # rule with items says how many a key holds at most
    items: Mapping[str, Collection[str]] | None = None
    items_max: int = 0
    # keys of an old shard while a reshard runs: written only where the shard still
    # holds them, the others come back as ``asked`` (for their new shard)
    held: bool = False
    # key -> its touch's time (config/schedule.py), for some of ``keys``
    schedules: Mapping[str, str] | None = None
    # the rule's ``edge: leading``: a quiet key's first touch is due at once
    leading: bool = False


@dataclass(frozen=True, slots=True)
class UpsertResult:
    """What an upsert call did: how many keys it scheduled, the keys it could not
    (key -> the error Redis met), which it skipped, and the ``held`` keys the shard
    did not hold (to write to their new shard)."""

    scheduled: int
    failed: dict[str, str]
    asked: tuple[str, ...] = ()
    seq: int = 0  # the shard's fencing tokens so far, when it asked keys away
    # bundles of asked keys still in transit (taken out by a mover, not yet deleted):
    # the writer puts them into their new shard before its touch
    transit: tuple[str, ...] = ()


class ClaimedKey(NamedTuple):
    """One claim as the claim script granted it (a tuple: a drain parses thousands a
    second, and a tuple is built in a fifth of a frozen dataclass's time). ``items``
    (sorted) and ``overflowed`` are its items, for a rule with items."""

    rule_index: int
    key: str
    token: int
    first_ms: int
    last_ms: int
    attempt: int
    due_ms: int
    items: tuple[str, ...] = ()
    overflowed: bool = False
    touches: int = 1  # the burst's touches that reached Redis (each flush of the key once)


@dataclass(frozen=True, slots=True)
class AckAnswer:
    """What an ack call found: the keys whose token was stale, and per group how many
    keys were touched while they ran (re-armed: each runs again)."""

    stale: list[str]
    rearmed: list[int]


@dataclass(frozen=True, slots=True)
class LimitsAnswer:
    """What limits.lua found on one shard: its pending keys (due sets), the dead
    letters it dropped for their age and for their count, and those it keeps."""

    pending: int
    dropped_by_age: int
    dropped_by_count: int
    dead: int


@dataclass(frozen=True, slots=True)
class CancelGroup:
    """Keys of one rule whose pending refreshes to drop."""

    rule: str
    keys: Sequence[str]


@dataclass(frozen=True, slots=True)
class CancelAnswer:
    """What a cancel call found: each key's state (one of CANCEL_STATES), and the
    bundles of its idle keys still in transit to a new shard (a reshard), with the
    shard's fencing tokens so far (to put them there, see store/layout.py)."""

    states: dict[str, str]
    seq: int = 0
    transit: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    """What a claim call returned: the claims and when to look again."""

    now_ms: int
    next_due_ms: int | None
    next_expiry_ms: int | None
    live_nodes: int
    claims: list[ClaimedKey]
    blocked: bool = False
    held: dict[int, int] = field(default_factory=dict)  # blocked rule index -> keys due now


@dataclass(frozen=True, slots=True)
class RateGrant:
    """What a take_rate call granted: starts, and the ms until more are there (0: none
    are wanted beyond the grant)."""

    granted: int
    wait_ms: int


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed try of a claim, and how long to wait before the next.

    ``outcome`` ("failure" or "timeout"), ``start_ms`` (server clock) and
    ``duration_ms`` go to the shard's refresh history.
    """

    key: str
    token: int
    delay_ms: int
    error: str
    outcome: str = "failure"
    start_ms: int = 0
    duration_ms: int = 0


# A successful claim to ack: (key, token), or (key, token, start ms, duration ms)
# to give its history entry the refresh's start (server clock) and duration.
AckItem = tuple[str, int] | tuple[str, int, int, int]
# The acks of one rule: (rule, items), or (rule, items, size) for one batch handler call
# of ``size`` keys.
AckGroup = tuple[str, Sequence[AckItem]] | tuple[str, Sequence[AckItem], int]


@dataclass(frozen=True, slots=True)
class History:
    """Where finished refreshes are recorded: the recording node and the stream's cap."""

    node_id: str = ""
    length: int = 0  # 0: nothing is recorded

    def args(self, shard: ShardKeys) -> tuple[list[str], list[Any]]:
        return [shard.meta, shard.next_wake, shard.history], [
            shard.wake_channel, self.node_id, self.length]


NO_HISTORY = History()


@dataclass(frozen=True, slots=True)
class LeaseState:
    """Who holds a shard's leader lease after an acquire call."""

    epoch: int
    holder: str
    ttl_ms: int
    live_nodes: int
    adopt: tuple[str, ...] = ()  # rules the holder lacks that the caller is to serve

    @property
    def granted(self) -> bool:
        return self.epoch > 0


@dataclass(frozen=True, slots=True)
class NodeLeases:
    """What a node_lease call found: the server time, whether the caller's lease was
    missing from the set before the call (never taken, or dropped by a node that judged
    it lapsed), and every node's lease end (server ms). Which of them lapsed each reader
    judges by its own clock (``worker.lease_clock``)."""

    now_ms: int
    lapsed: bool
    ends: dict[str, int]


@dataclass(frozen=True, slots=True)
class Benched:
    """What a bench call found: the server time, whether the caller was benched, and
    every benched node's cool-off end (server ms)."""

    now_ms: int
    benched: bool
    ends: dict[str, int]


@dataclass(frozen=True, slots=True)
class AdoptBatch:
    """What an adopt call returned: claims of rules the leader lacks, when to look again."""

    now_ms: int
    next_due_ms: int | None
    next_expiry_ms: int | None
    claims: list[ClaimedKey]
    blocked: bool
    served: int  # how many of the asked rules this node serves on the shard now
    held: dict[int, int] = field(default_factory=dict)  # as ClaimBatch.held


@dataclass(frozen=True, slots=True)
class Hastened:
    """What a hasten call did on one shard, over the rules it was given."""

    now_ms: int
    hastened: int
    pending: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class Peer:
    """A live worker node of a shard and the rules it registered ("" for none)."""

    node: str
    last_seen_ms: int
    rules: str


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
