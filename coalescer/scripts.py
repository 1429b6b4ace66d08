"""The Lua scripts, registered once, each behind a small typed function.

Every atomic step of coalescer is one file in ``lua/``; each opens with a
header naming its KEYS, ARGV and return value. ``_lib.lua`` is prepended to
each of them. redis-py's ``register_script`` runs them by SHA and reloads a
script that the server lost (``SCRIPT FLUSH``, a restart, a failover).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .errors import NotLeaderError, ScriptError
from .keys import ShardKeys

KEY_SEPARATOR = "\0"  # one argument for a batch's keys: far cheaper to encode than many

SCRIPT_NAMES = (
    "upsert", "claim", "ack", "fail", "renew", "recover", "requeue", "acquire", "release",
)


def script_source(name: str) -> str:
    """The text sent to Redis for script ``name``: the shared helpers, then it."""
    folder = resources.files("coalescer") / "lua"
    lib = (folder / "_lib.lua").read_text()
    return lib + "\n" + (folder / f"{name}.lua").read_text()


@dataclass(frozen=True, slots=True)
class UpsertGroup:
    """Keys of one rule to schedule: the rule's window and max wait in ms."""

    rule: str
    window_ms: int
    max_wait_ms: int
    keys: Sequence[str]


@dataclass(frozen=True, slots=True)
class ClaimedKey:
    """One claim as the claim script granted it."""

    rule_index: int
    key: str
    token: int
    first_ms: int
    last_ms: int
    attempt: int
    due_ms: int


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    """What a claim call returned: the claims and when to look again."""

    now_ms: int
    next_due_ms: int | None
    next_expiry_ms: int | None
    live_nodes: int
    claims: list[ClaimedKey]
    blocked: bool = False


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed try of a claim, and how long to wait before the next."""

    key: str
    token: int
    delay_ms: int
    error: str


@dataclass(frozen=True, slots=True)
class LeaseState:
    """Who holds a shard's leader lease after an acquire call."""

    epoch: int
    holder: str
    ttl_ms: int
    live_nodes: int

    @property
    def granted(self) -> bool:
        return self.epoch > 0


def _optional(value: Any) -> int | None:
    number = int(value)
    return None if number < 0 else number


def _claims(encoded: Sequence[str]) -> list[ClaimedKey]:
    out = []
    for item in encoded:
        r, token, first, last, attempt, due, key = item.split("|", 6)
        out.append(ClaimedKey(int(r), key, int(token), int(first), int(last), int(attempt),
                              int(due)))
    return out


class Scripts:
    """The registered scripts of one Redis (or Redis Cluster) client."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES}

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(args))

    async def upsert(self, shard: ShardKeys, groups: Sequence[UpsertGroup]) -> int:
        """Schedule the groups' keys; returns how many were scheduled."""
        keys = [shard.meta, shard.next_wake]
        args: list[Any] = [shard.wake_channel]
        for g in groups:
            keys += [shard.due(g.rule), shard.dead(g.rule)]
            args += [g.window_ms, g.max_wait_ms, len(g.keys), KEY_SEPARATOR.join(g.keys)]
        result = await self._run("upsert", keys, args)
        return int(result[1])

    async def claim(self, shard: ShardKeys, *, leader: str, node_id: str, leader_lease_ms: int,
                    claim_lease_ms: int, sleep_cap_ms: int,
                    limits: Sequence[tuple[str, int]]) -> ClaimBatch:
        """Claim up to each rule's limit of due keys; NotLeaderError if the lease is lost."""
        keys = [shard.leader, shard.meta, shard.seq, shard.next_wake, shard.nodes]
        args: list[Any] = [leader, leader_lease_ms, claim_lease_ms, sleep_cap_ms, node_id]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args.append(limit)
        result = await self._run("claim", keys, args)
        if int(result[0]) == 0:
            raise NotLeaderError(f"shard {shard.shard}: lease {leader!r} is no longer held")
        if int(result[0]) != 1:
            raise ScriptError(f"claim answered {result!r}")
        return ClaimBatch(int(result[1]), _optional(result[2]), _optional(result[3]),
                          int(result[4]), _claims(result[5]), bool(int(result[6])))

    async def ack(self, shard: ShardKeys,
                  groups: Sequence[tuple[str, Sequence[tuple[str, int]]]]) -> list[str]:
        """Finish successful claims; returns the keys whose token was stale."""
        keys = [shard.meta, shard.next_wake]
        args: list[Any] = [shard.wake_channel]
        for rule, items in groups:
            keys += [shard.due(rule), shard.inflight(rule)]
            args.append(len(items))
            for key, token in items:
                args += [key, token]
        result = await self._run("ack", keys, args)
        return [str(k) for k in result[2:]]

    async def fail(
        self, shard: ShardKeys, groups: Sequence[tuple[str, int, Sequence[Failure]]],
    ) -> tuple[int, int, list[str]]:
        """Record failed tries: (retried, dead-lettered, stale keys)."""
        keys = [shard.meta, shard.next_wake]
        args: list[Any] = [shard.wake_channel]
        for rule, max_attempts, failures in groups:
            keys += [shard.due(rule), shard.inflight(rule), shard.dead(rule)]
            args += [max_attempts, len(failures)]
            for f in failures:
                args += [f.key, f.token, f.delay_ms, f.error]
        result = await self._run("fail", keys, args)
        return int(result[0]), int(result[1]), [str(k) for k in result[2:]]

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
        return [str(k) for k in await self._run("renew", keys, args)]

    async def recover(self, shard: ShardKeys, rules: Sequence[str], limit: int,
                      attempts: Sequence[int] = ()) -> int:
        """Re-queue claims whose lease expired; returns how many. ``attempts`` are the
        rules' retry limits, in the order of ``rules`` (none given: no limit)."""
        keys = [shard.meta, shard.next_wake]
        for rule in rules:
            keys += [shard.due(rule), shard.inflight(rule)]
        result = await self._run("recover", keys, [shard.wake_channel, limit, *attempts])
        return int(result[0])

    async def requeue(self, shard: ShardKeys, rule: str, dead_keys: Sequence[str]) -> int:
        """Bring dead-lettered keys of ``rule`` back; returns how many."""
        keys = [shard.meta, shard.next_wake, shard.due(rule), shard.dead(rule)]
        result = await self._run("requeue", keys, [shard.wake_channel, *dead_keys])
        return int(result[0])

    async def acquire(self, shard: ShardKeys, *, node_id: str, lease_ms: int,
                      mine: str) -> LeaseState:
        """Take or renew the shard's leader lease."""
        keys = [shard.leader, shard.epoch, shard.nodes]
        epoch, holder, ttl, live = await self._run("acquire", keys, [node_id, lease_ms, mine])
        return LeaseState(int(epoch), str(holder), int(ttl), int(live))

    async def release(self, shard: ShardKeys, *, value: str, node_id: str, leave: bool) -> bool:
        """Give up the shard's lease if still held; ``leave`` also leaves the node set."""
        keys = [shard.leader, shard.nodes]
        args = [value, shard.wake_channel, node_id, "1" if leave else "0"]
        return int(await self._run("release", keys, args)) == 1
