"""The Lua scripts, registered once, each behind a small typed function.

Every atomic step of coalescer is one file in ``lua/``; each opens with a
header naming its KEYS, ARGV and return value. ``_lib.lua`` is prepended to
each of them. redis-py's ``register_script`` runs them by SHA and reloads a
script that the server lost (``SCRIPT FLUSH``, a restart, a failover).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, NamedTuple

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from coalescer.common.plural import plural
from coalescer.config.durability import NO_REPLICAS, Durability
from coalescer.config.model import RateLimit
from coalescer.errors import LayoutMovedError, NotLeaderError, ReplicationError, ScriptError
from coalescer.store.batching import ScriptBatcher
from coalescer.store.keys import ShardKeys
from coalescer.store.replicas import ReplicationWatch

log = logging.getLogger(__name__)

KEY_SEPARATOR = "\0"  # one argument for a batch's keys: far cheaper to encode than many
OVERFLOW = ""  # the member of a key's items set that says its items overflowed (_lib.lua)
NO_ITEM_RULES: Mapping[str, int] = {}

# The writes that count only once ``durability: replicas`` hold them (batching.py):
# touches (a flush), claims (fencing tokens and in-flight state) and acks.
DURABLE = frozenset({"upsert", "claim", "adopt", "take", "ack"})
# where the claims are in the reply of each claiming script (given back when unconfirmed)
CLAIMS_AT = {"claim": 5, "adopt": 3, "take": 1}
LEASE_CALLS = ("node_lease", "renew")  # sent at once, on the leases' own client if given

SCRIPT_NAMES = (
    "upsert", "claim", "ack", "fail", "renew", "recover", "requeue", "acquire", "release",
    "adopt", "peers", "node_lease", "unclaim",
    "purge", "hasten", "take", "take_rate", "cancel",
    "layout", "reshard_begin", "reshard_drained", "reshard_take", "reshard_put", "bench",
    "limits", "run_now", "traces_put", "traces_take",
)

# What run_now.lua found a key in: the first two run next (see run_now.lua).
RUN_NOW_STATES = ("hastened", "due", "running", "dead", "idle")

# What cancel.lua found each key in: the first two had a refresh to drop (see cancel.lua).
CANCEL_STATES = ("pending", "rearm", "running", "dead", "idle")


def script_source(name: str) -> str:
    """The text sent to Redis for script ``name``: the shared helpers, then it. A script
    whose file opens with a ``#!lua flags=...`` line keeps that line first (Redis reads
    flags only there): ``allow-oom`` marks the steps that take work out of Redis or keep
    leases, which must run at ``maxmemory`` under ``noeviction`` (they free about what
    they write), while touches are refused there and stay buffered."""
    folder = resources.files("coalescer.store") / "lua"
    lib = (folder / "_lib.lua").read_text()
    text = (folder / f"{name}.lua").read_text()
    if text.startswith("#!"):
        shebang, text = text.split("\n", 1)
        return f"{shebang}\n{lib}\n{text}"
    return lib + "\n" + text


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


def _optional(value: Any) -> int | None:
    number = int(value)
    return None if number < 0 else number


def _claims(encoded: Sequence[str], items: Sequence[Sequence[Any]] = ()) -> list[ClaimedKey]:
    out, make = [], ClaimedKey._make
    for item in encoded:
        r, token, first, last, attempt, due, count, key = item.split("|", 7)
        out.append(make((int(r), key, int(token), int(first), int(last), int(attempt),
                         int(due), (), False, int(count))))
    for position, *members in items:
        i = int(position)
        found = set(map(str, members))
        overflowed = OVERFLOW in found
        found.discard(OVERFLOW)
        out[i] = out[i]._replace(items=tuple(sorted(found)), overflowed=overflowed)
    return out


def _items_section(shard: ShardKeys, item_rules: Mapping[str, int],
                   rules: Sequence[str]) -> list[Any]:
    """The items section of a claiming script's arguments (none when no rule of the call
    has items: such a call costs what it did before items existed)."""
    if not item_rules or not any(rule in item_rules for rule in rules):
        return []
    return [shard.items_prefix, shard.claimed_prefix,
            *(item_rules.get(rule, 0) for rule in rules)]


def _upsert_items(groups: Sequence[UpsertGroup]) -> list[Any]:
    """The items section of an upsert call (none for plain touches)."""
    args: list[Any] = []
    for g in groups:
        if g.items:
            fields: list[str] = []
            for key, items in g.items.items():
                fields += (key, str(len(items)), *items)
            args += [g.items_max, KEY_SEPARATOR.join(fields)]
    return args


def _upsert_times(group: UpsertGroup) -> str:
    """The times section of a group ("" for plain touches): KEY NUL TIME NUL ..."""
    if not group.schedules:
        return ""
    return KEY_SEPARATOR.join(f for pair in group.schedules.items() for f in pair)


def _held(encoded: Sequence[str]) -> dict[int, int]:
    pairs = (item.split("|", 1) for item in encoded)
    return {int(r): int(n) for r, n in pairs}


def _by_client(scripts: Iterable[Any]) -> dict[Any, list[Any]]:
    by: dict[Any, list[Any]] = {}
    for script in scripts:
        by.setdefault(script.registered_client, []).append(script)
    return by


async def _load(client: Any, sources: list[str]) -> None:
    """SCRIPT LOAD each of ``sources`` on ``client``: one round trip on a single server
    (a pipeline); on a Redis Cluster one after the other, each to every master at once
    (all at once would take more connections than a client's bound)."""
    if isinstance(client, RedisCluster):
        for source in sources:
            await client.script_load(source)
        return
    async with client.pipeline(transaction=False) as pipe:
        for source in sources:
            pipe.script_load(source)
        await pipe.execute()


class Scripts:
    """The registered scripts of one Redis (or Redis Cluster) client."""

    def __init__(self, redis: Any, durability: Durability = NO_REPLICAS, *,
                 leases: Any = None) -> None:
        """``leases``: a client of its own for the lease calls (``LEASE_CALLS``)."""
        self._redis = redis
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES}
        if leases is not None:
            self._scripts |= {name: leases.register_script(script_source(name))
                              for name in LEASE_CALLS}
        # calls travel in pipelines, never one per shard; DURABLE ones end with WAIT
        self._batcher = ScriptBatcher(redis, durability)
        self._acks_unreplicated = False  # an ack's WAIT fell short (logged once a run)
        self.traced = False  # acks delete the done keys' trace contexts (tracing on here)
        # whether the durable calls are confirmed now, and why not (store/replicas.py)
        self.replication = ReplicationWatch(redis, durability)
        self._confirming = durability.replicas > 0

    async def preload(self) -> None:
        """Load every script now, on each client at once: a first call would otherwise
        cost three more round trips (NOSCRIPT, then SCRIPT LOAD and the call again),
        which a slow link makes long enough to lose a node's first claims."""
        await asyncio.gather(*(_load(client, [s.script for s in scripts]) for client, scripts
                               in _by_client(self._scripts.values()).items()))

    @property
    def client(self) -> Any:
        """The Redis client the scripts run on (for plain commands next to them)."""
        return self._redis

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        durable = name in DURABLE
        try:
            result = await self._batcher.call(self._scripts[name], list(keys), list(args),
                                              durable=durable)
        except ReplicationError as exc:
            self.replication.fell_short(exc.acknowledged)
            raise
        if durable and self._confirming:
            self.replication.confirmed()
        return result

    async def _run_now(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One call sent at once, not queued behind the batcher's (on a Redis Cluster, a
        node's lease renewal would otherwise wait behind its shards' calls, and lapse)."""
        return await self._scripts[name](keys=list(keys), args=list(args))

    async def traces_put(self, shard: ShardKeys, values: Mapping[str, str], keep: int,
                         grace_ms: int) -> int:
        """Keep trace contexts beside their keys (``values``: key -> the form
        traces_put.lua merges), at most ``keep`` at each end of a burst, only for keys
        that have a state; they expire ``grace_ms`` after the key's due time. Returns how
        many keys got theirs."""
        if not values:
            return 0
        args: list[Any] = [keep, grace_ms]
        for key, value in values.items():
            args += [key, value]
        return int(await self._run("traces_put",
                                   [shard.meta, *(shard.traces(k) for k in values)], args))

    async def traces_take(self, shard: ShardKeys, keys: Sequence[str]) -> list[str | None]:
        """The trace contexts kept for ``keys`` (None where none), deleted."""
        if not keys:
            return []
        found = await self._run("traces_take", [shard.traces(k) for k in keys], [])
        return [str(v) if v else None for v in found]

    async def upsert(self, shard: ShardKeys, groups: Sequence[UpsertGroup]) -> int:
        """Schedule the groups' keys; returns how many. ScriptError if a key failed."""
        result = await self.upsert_keys(shard, groups)
        if result.failed:
            raise ScriptError(f"upsert failed for {plural(len(result.failed), 'key')}: "
                              f"{sorted(result.failed.items())[:3]!r}")
        return result.scheduled

    async def upsert_keys(self, shard: ShardKeys, groups: Sequence[UpsertGroup],
                          gen: int = 1, min_seq: int = 0) -> UpsertResult:
        """Schedule the groups' keys, written with layout generation ``gen``; the keys
        Redis failed on are skipped and returned. ``min_seq``: the tokens granted by
        the old shard that asked these keys away. LayoutMovedError: the shard follows
        a newer layout, and nothing was written."""
        keys = [shard.meta, shard.next_wake, shard.layout, shard.seq, shard.moving,
                shard.bytes]
        args: list[Any] = [shard.wake_channel, gen, min_seq]
        for g in groups:
            keys += [shard.due(g.rule), shard.dead(g.rule)]
            args += [g.window_ms, g.max_wait_ms, len(g.keys), KEY_SEPARATOR.join(g.keys),
                     1 if g.held else 0, _upsert_times(g)]
        items = _upsert_items(groups)
        if items or any(g.schedules for g in groups):  # a schedule drops the old items
            args += [shard.items_prefix, *items]
        result = await self._run("upsert", keys, args)
        if int(result[0]) == 0:
            raise LayoutMovedError(shard.shard, int(result[1]))
        failed = result[3] if len(result) > 3 else []
        return UpsertResult(int(result[1]),
                            {str(failed[i]): str(failed[i + 1]) for i in range(0, len(failed), 2)},
                            tuple(str(k) for k in result[4]) if len(result) > 4 else (),
                            int(result[5]) if len(result) > 5 else 0,
                            tuple(str(b) for b in result[6]) if len(result) > 6 else ())

    async def limits(self, shard: ShardKeys, rules: Sequence[str], *, keep_dead: int,
                     dead_ttl_ms: int, budget: int) -> LimitsAnswer:
        """Count the shard's pending keys; drop its dead letters older than
        ``dead_ttl_ms``, then its oldest past ``keep_dead`` (at most ``budget``)."""
        keys = [shard.meta, *(shard.due(r) for r in rules), *(shard.dead(r) for r in rules)]
        args = [len(rules), shard.items_prefix, shard.claimed_prefix, keep_dead, dead_ttl_ms,
                budget, shard.traces_prefix]
        found = await self._run("limits", keys, args)
        return LimitsAnswer(*(int(n) for n in found))

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run script ``name`` (for the typed wrappers of other modules: store/layout.py)."""
        return await self._run(name, keys, args)

    async def claim(self, shard: ShardKeys, *, leader: str, node_id: str,
                    claim_lease_ms: int, sleep_cap_ms: int,
                    limits: Sequence[tuple[str, int]],
                    item_rules: Mapping[str, int] = NO_ITEM_RULES) -> ClaimBatch:
        """Claim up to each rule's limit of due keys; NotLeaderError if the lease is lost.
        ``item_rules`` maps each rule with items to its items max: their claims get
        their items. A rule in the shard's paused set claims none, whatever its limit."""
        keys = [shard.leader, shard.meta, shard.seq, shard.next_wake, shard.nodes,
                shard.paused]
        args: list[Any] = [leader, claim_lease_ms, sleep_cap_ms, node_id]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args.append(limit)
        args += _items_section(shard, item_rules, [rule for rule, _ in limits])
        result = await self._claiming("claim", shard, keys, args, limits)
        if int(result[0]) == 0:
            raise NotLeaderError(f"shard {shard.shard}: lease {leader!r} is no longer held")
        if int(result[0]) != 1:
            raise ScriptError(f"claim answered {result!r}")
        return ClaimBatch(int(result[1]), _optional(result[2]), _optional(result[3]),
                          int(result[4]),
                          _claims(result[5], result[8] if len(result) > 8 else ()),
                          bool(int(result[6])),
                          _held(result[7]) if len(result) > 7 else {})

    async def _claiming(self, name: str, shard: ShardKeys, keys: Sequence[str],
                        args: Sequence[Any], limits: Sequence[tuple[str, int]]) -> Any:
        """Run the claiming script ``name``; the claims of a call too few replicas
        confirmed are given back before its ReplicationError is raised."""
        try:
            return await self._run(name, keys, args)
        except ReplicationError as exc:
            reply = exc.result
            at = CLAIMS_AT[name]
            if isinstance(reply, list) and len(reply) > at:
                await self._unclaim(shard, [rule for rule, _ in limits], reply[at])
            raise

    async def _unclaim(self, shard: ShardKeys, rules: Sequence[str],
                       encoded: Sequence[str]) -> None:
        """Give back the ``encoded`` claims too few replicas confirmed: they are not run,
        and go back to pending without counting an attempt. If that fails too, their
        claim lease runs out and they are recovered."""
        held: list[list[tuple[str, int]]] = [[] for _ in rules]
        for claim in _claims(encoded):
            held[claim.rule_index].append((claim.key, claim.token))
        if not any(held):
            return
        keys = [shard.meta, shard.next_wake]
        args: list[Any] = [shard.wake_channel]
        for rule, claims in zip(rules, held, strict=True):
            keys += [shard.due(rule), shard.inflight(rule)]
            args += [len(claims), *(part for claim in claims for part in claim)]
        try:
            await self._run("unclaim", keys, args)
        except (RedisError, OSError) as exc:
            log.debug("shard %d: giving back unconfirmed claims failed: %r", shard.shard, exc)

    async def ack(self, shard: ShardKeys, groups: Sequence[AckGroup],
                  history: History = NO_HISTORY,
                  item_rules: Collection[str] = ()) -> list[str]:
        """Finish successful claims (and record them); returns the keys whose token was stale.

        A group is ``(rule, items)``, or ``(rule, items, size)`` for the claims of one
        batch handler call of ``size`` keys: their successes share one history entry.
        The claims of ``item_rules`` (rules with items) drop their delivered items."""
        return (await self.ack_counted(shard, groups, history, item_rules)).stale

    async def ack_counted(self, shard: ShardKeys, groups: Sequence[AckGroup],
                          history: History = NO_HISTORY,
                          item_rules: Collection[str] = ()) -> AckAnswer:
        """``ack``, also saying how many keys of each group were touched while they ran
        (each runs again)."""
        keys, args = history.args(shard)
        args.append(shard.traces_prefix if self.traced else "")
        for rule, items, *batched in groups:
            keys += [shard.due(rule), shard.inflight(rule)]
            args += [rule, len(items), KEY_SEPARATOR.join([
                f"{item[1]}|{item[2]}|{item[3]}|{item[0]}" if len(item) == 4
                else f"{item[1]}|0|0|{item[0]}" for item in items]),
                batched[0] if batched and batched[0] else ""]
        if item_rules and any(group[0] in item_rules for group in groups):
            args += [shard.claimed_prefix,
                     *("1" if group[0] in item_rules else "0" for group in groups)]
        if history.node_id:  # a receipt: this call replayed gets the same answer
            keys.append(shard.acked(history.node_id))
            args.append(uuid.uuid4().hex)
        try:
            result = await self._run("ack", keys, args)
        except ReplicationError as exc:
            result = self._unreplicated_ack(shard, exc)
        else:
            self._acks_unreplicated = False
        return AckAnswer(stale=[str(k) for k in result[2:]],
                         rearmed=[int(n) for n in str(result[1]).split(",") if n])

    def _unreplicated_ack(self, shard: ShardKeys, exc: ReplicationError) -> Any:
        """An ack the primary recorded but too few replicas confirmed: it is not sent again
        (the claim is finished there); a failover before the replicas catch up runs the
        refresh once more (never loses it). Logged once until an ack is confirmed."""
        if not self._acks_unreplicated:
            self._acks_unreplicated = True
            log.warning("shard %d: refresh results recorded on the primary, but %s; a "
                        "failover now would run those refreshes again", shard.shard, exc)
        return exc.result

    async def fail(
        self, shard: ShardKeys, groups: Sequence[tuple[str, int, Sequence[Failure]]],
        history: History = NO_HISTORY,
    ) -> tuple[int, list[str], list[str]]:
        """Record failed tries (and their history): (how many were retried, the keys
        dead-lettered, the stale keys: claims this node no longer held)."""
        keys, args = history.args(shard)
        for rule, max_attempts, failures in groups:
            keys += [shard.due(rule), shard.inflight(rule), shard.dead(rule)]
            args += [rule, max_attempts, len(failures)]
            for f in failures:
                args += [f.key, f.token, f.delay_ms, f.error, f.outcome, f.start_ms,
                         f.duration_ms]
        result = await self._run("fail", keys, args)
        return int(result[0]), [str(k) for k in result[1]], [str(k) for k in result[2]]

    async def renew(self, shard: ShardKeys, lease_ms: int,
                    groups: Sequence[tuple[str, Sequence[tuple[str, int]]]]) -> list[str]:
        """Extend running claims' leases; returns the keys this node lost."""
        keys = [shard.meta]
        args: list[Any] = [lease_ms]
        for rule, items in groups:
            keys.append(shard.inflight(rule))
            args.append(len(items))
            for key, token in items:
                args += [key, token]
        # sent at once, never queued behind the batcher's calls: a renewal has a deadline
        return [str(k) for k in await self._run_now("renew", keys, args)]

    async def recover(self, shard: ShardKeys, rules: Sequence[str], limit: int,
                      attempts: Sequence[int] = (),
                      lapsed: Sequence[Sequence[tuple[str, int]]] | None = None) -> int:
        """Re-queue claims whose lease expired; returns how many. ``attempts`` are the
        rules' retry limits, in the order of ``rules`` (none given: no limit).

        ``lapsed`` (one list per rule, with ``attempts`` given): only these claims, each
        while its lease score is still the one given (the caller judged them lapsed by
        its own clock); without it, those expired by the server's clock."""
        keys = [shard.meta, shard.next_wake]
        for rule in rules:
            keys += [shard.due(rule), shard.inflight(rule)]
        args: list[Any] = [shard.wake_channel, limit, *attempts]
        if lapsed is not None:
            if len(attempts) != len(rules) or len(lapsed) != len(rules):
                raise ValueError("recover: lapsed claims need every rule's attempts")
            for pairs in lapsed:
                args.append(len(pairs))
                for key, score in pairs:
                    args += [key, score]
        result = await self._run("recover", keys, args)
        return int(result[0])

    async def lease_scores(self, shard: ShardKeys, rules: Sequence[str], limit: int,
                           upto_ms: int | None) -> list[dict[str, int]]:
        """Per rule, the claims held in the shard with their lease score (the server time
        their lease was last renewed to): those up to ``upto_ms``, or all (``None``), at
        most ``limit`` per rule, lowest first. Plain reads, one pipeline."""
        pipe = self._redis.pipeline(transaction=False)
        high: int | str = "+inf" if upto_ms is None else upto_ms
        for rule in rules:
            pipe.zrangebyscore(shard.inflight(rule), "-inf", high, start=0, num=limit,
                               withscores=True)
        return [{str(k): int(v) for k, v in found} for found in await pipe.execute()]

    async def requeue(self, shard: ShardKeys, rule: str, dead_keys: Sequence[str]) -> int:
        """Bring dead-lettered keys of ``rule`` back; returns how many."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        result = await self._run("requeue", keys, [shard.wake_channel, *dead_keys])
        return int(result[0])

    async def requeue_each(self, shard: ShardKeys, rule: str,
                           dead_keys: Sequence[str]) -> tuple[int, list[str]]:
        """Bring dead-lettered keys of ``rule`` back: (how many, the keys that were not dead)."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        result = await self._run("requeue", keys, [shard.wake_channel, *dead_keys])
        return int(result[0]), [str(k) for k in result[1:]]

    async def purge(self, shard: ShardKeys, rule: str,
                    dead_keys: Sequence[str]) -> tuple[int, list[str]]:
        """Delete dead-lettered keys of ``rule``: (how many, the keys that were not dead)."""
        result = await self._run("purge", [shard.meta, shard.dead(rule)],
                                 [shard.items_prefix, shard.claimed_prefix,
                                  shard.traces_prefix, *dead_keys])
        return int(result[0]), [str(k) for k in result[1:]]

    async def cancel(self, shard: ShardKeys, groups: Sequence[CancelGroup],
                     history: History = NO_HISTORY) -> CancelAnswer:
        """Drop the groups' keys' pending refreshes (and the re-arms of running ones):
        each key with the state it was found in, and the keys in transit."""
        keys = [shard.meta, shard.history, shard.moving, shard.seq]
        args: list[Any] = [history.node_id, history.length, shard.items_prefix,
                           shard.claimed_prefix, shard.traces_prefix]
        for g in groups:
            keys.append(shard.due(g.rule))
            args += [g.rule, len(g.keys), KEY_SEPARATOR.join(g.keys)]
        _, found, seq, transit = await self._run("cancel", keys, args)
        names = [k for g in groups for k in g.keys]
        states = [str(s) for s in found]
        if len(states) != len(names) or not set(states) <= set(CANCEL_STATES):
            raise ScriptError(f"cancel answered {found!r} for {plural(len(names), 'key')}")
        return CancelAnswer(dict(zip(names, states, strict=True)), int(seq),
                            tuple(str(b) for b in transit))

    async def acquire(self, shard: ShardKeys, *, node_id: str, lease_ms: int,
                      mine: str, rules: str = "", take_from: str = "") -> LeaseState:
        """Take or keep the shard's leadership; register ``rules`` (registry.encode).
        ``take_from`` is a holder value whose node's lease the caller saw lapse: the
        shard is taken over if it still holds that value."""
        keys = [shard.leader, shard.epoch, shard.nodes, shard.rules, shard.rule_names]
        epoch, holder, ttl, live, adopt = await self._run(
            "acquire", keys, [node_id, lease_ms, mine, rules, take_from, shard.wake_channel])
        return LeaseState(int(epoch), str(holder), int(ttl), int(live),
                          tuple(str(n) for n in adopt))

    async def adopt(self, shard: ShardKeys, *, node_id: str, claim_lease_ms: int,
                    limits: Sequence[tuple[str, int]],
                    item_rules: Mapping[str, int] = NO_ITEM_RULES) -> AdoptBatch:
        """Claim due keys of rules the shard's leader lacks, where this node serves them."""
        keys = [shard.leader, shard.meta, shard.seq, shard.nodes, shard.rules, shard.paused]
        args: list[Any] = [node_id, claim_lease_ms]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args += [rule, limit]
        args += _items_section(shard, item_rules, [rule for rule, _ in limits])
        now, due, expiry, claims, blocked, served, *rest = await self._claiming(
            "adopt", shard, keys, args, limits)
        return AdoptBatch(int(now), _optional(due), _optional(expiry),
                          _claims(claims, rest[1] if len(rest) > 1 else ()),
                          bool(int(blocked)), int(served), _held(rest[0]) if rest else {})

    async def peers(self, shard: ShardKeys, live_ms: int) -> tuple[int, list[Peer]]:
        """Server time and the shard's live worker nodes with their registered rules."""
        result = await self._run("peers", [shard.nodes, shard.rules], [live_ms])
        rest = result[1:]
        return int(result[0]), [Peer(str(rest[i]), int(float(rest[i + 1])), str(rest[i + 2]))
                                for i in range(0, len(rest), 3)]

    async def node_lease(self, leases: str, *, node_id: str, lease_ms: int,
                         period_ms: int = 0,
                         forgotten: Sequence[tuple[str, int]] = ()) -> NodeLeases:
        """Renew this node's lease (``lease_ms`` 0: drop it; ``period_ms``: to end on a
        multiple of it plus the lease) and read every node's; ``forgotten`` are nodes
        judged lapsed, with the lease end read, whose shard entries this node removed."""
        args: list[Any] = [node_id, lease_ms, period_ms]
        for node, ends in forgotten:
            args += [node, ends]
        return self._node_leases(await self._run_now("node_lease", [leases], args))

    async def lease_ends(self, leases: str) -> dict[str, int]:
        """Every node's lease end (server ms): one plain ZRANGE, no script, no clock (a look
        between renewals, see node_lease.py)."""
        every = await self._redis.zrange(leases, 0, -1, withscores=True)
        return {str(node): int(float(ends)) for node, ends in every}

    async def lease_look(self, leases: str) -> NodeLeases:
        """Every node's lease end with the server's time, renewing nothing: one script
        call, one read inside (a look between renewals, see node_lease.py)."""
        return self._node_leases(await self._run_now("node_lease", [leases], ["", -1, 0]))

    async def bench(self, benched: str, leases: str, *, node_id: str, cool_off_ms: int,
                    others: Sequence[str]) -> Benched:
        """Bench this node for ``cool_off_ms`` if one of ``others`` (the other nodes it
        counts live) has a lease and is not benched; ``cool_off_ms`` -1 only reads who is
        benched now."""
        now, done, every = await self._run_now("bench", [benched, leases],
                                               [node_id, cool_off_ms, *others])
        ends = {str(every[i]): int(float(every[i + 1])) for i in range(0, len(every), 2)}
        return Benched(int(now), bool(int(done)), ends)

    @staticmethod
    def _node_leases(result: Any) -> NodeLeases:
        now, lapsed, every = result
        ends = {str(every[i]): int(float(every[i + 1])) for i in range(0, len(every), 2)}
        return NodeLeases(int(now), bool(int(lapsed)), ends)

    async def forget(self, shards: Sequence[ShardKeys], node: str) -> None:
        """Drop a node whose lease lapsed from every shard's node set and rules registry:
        plain commands in one pipeline (on a Redis Cluster, one per master)."""
        pipe = self._redis.pipeline(transaction=False)
        for shard in shards:
            pipe.zrem(shard.nodes, node)
            pipe.hdel(shard.rules, node)
        await pipe.execute()

    async def release(self, shard: ShardKeys, *, value: str, node_id: str, leave: bool) -> bool:
        """Give up the shard's lease if still held; ``leave`` also leaves the node set."""
        keys = [shard.leader, shard.nodes]
        args = [value, shard.wake_channel, node_id, "1" if leave else "0"]
        return int(await self._run("release", keys, args)) == 1

    async def hasten(self, shard: ShardKeys, rules: Sequence[str], limit: int) -> Hastened:
        """Make up to ``limit`` pending keys of each rule due now; counts what is left."""
        keys = [shard.meta]
        for rule in rules:
            keys += [shard.due(rule), shard.inflight(rule)]
        now, hastened, pending, in_flight = await self._run("hasten", keys, [limit])
        return Hastened(int(now), int(hastened), int(pending), int(in_flight))

    async def run_now(self, shard: ShardKeys, rule: str, key: str) -> str:
        """Make pending ``key`` due now and wake the shard's poller; what it found: one
        of RUN_NOW_STATES ("hastened" or "due": it runs next)."""
        _now, state = await self._run("run_now", [shard.meta, shard.due(rule), shard.next_wake],
                                      [key, shard.wake_channel])
        return str(state)

    async def take_rate(self, bucket: str, rate: RateLimit, want: int,
                        give_back: int = 0) -> RateGrant:
        """Take up to ``want`` refresh starts from a rule's rate ``bucket``, after giving
        back ``give_back`` taken and not used."""
        granted, wait = await self._run("take_rate", [bucket], [
            rate.count, round(rate.per * 1000), rate.burst, want, give_back])
        return RateGrant(int(granted), int(wait))

    async def take(self, shard: ShardKeys, *, node_id: str, claim_lease_ms: int,
                   limits: Sequence[tuple[str, int]],
                   item_rules: Mapping[str, int] = NO_ITEM_RULES,
                   ) -> tuple[int, list[ClaimedKey]]:
        """Claim due keys for a drain, without the leader check: (server now, claims)."""
        keys = [shard.meta, shard.seq]
        args: list[Any] = [claim_lease_ms, node_id]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args.append(limit)
        args += _items_section(shard, item_rules, [rule for rule, _ in limits])
        now, claims, *items = await self._claiming("take", shard, keys, args, limits)
        return int(now), _claims(claims, items[0] if items else ())
