"""The claim side's script wrappers: claiming due keys (as the shard's leader, as an
adopter, for a drain), rate grants, then acking, failing, renewing and recovering claims."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from coalescer.config.model import RateLimit
from coalescer.errors import NotLeaderError, ReplicationError, ScriptError
from coalescer.store.fair_args import NO_FAIR, FairSpec, fair_section
from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import KEY_SEPARATOR, ScriptCalls
from coalescer.store.script_types import (
    NO_HISTORY,
    OVERFLOW,
    AckAnswer,
    AckGroup,
    AdoptBatch,
    ClaimBatch,
    ClaimedKey,
    Failure,
    History,
    RateGrant,
)

log = logging.getLogger(__name__)

NO_ITEM_RULES: Mapping[str, int] = {}
# where the claims are in the reply of each claiming script (given back when unconfirmed)
CLAIMS_AT = {"claim": 5, "adopt": 3, "take": 1}


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


def _held(encoded: Sequence[str]) -> dict[int, int]:
    pairs = (item.split("|", 1) for item in encoded)
    return {int(r): int(n) for r, n in pairs}


def _items_section(shard: ShardKeys, item_rules: Mapping[str, int],
                   rules: Sequence[str]) -> list[Any]:
    """The items section of a claiming script's arguments (none when no rule of the call
    has items: such a call costs what it did before items existed)."""
    if not item_rules or not any(rule in item_rules for rule in rules):
        return []
    return [shard.items_prefix, shard.claimed_prefix,
            *(item_rules.get(rule, 0) for rule in rules)]


class ClaimScripts(ScriptCalls):
    """Claiming keys and finishing claims."""

    _acks_unreplicated = False  # an ack's WAIT fell short (logged once a run)
    traced = False  # acks delete the done keys' trace contexts (tracing on here)

    async def claim(self, shard: ShardKeys, *, leader: str, node_id: str,
                    claim_lease_ms: int, sleep_cap_ms: int,
                    limits: Sequence[tuple[str, int]],
                    item_rules: Mapping[str, int] = NO_ITEM_RULES,
                    fair: Mapping[str, FairSpec] = NO_FAIR) -> ClaimBatch:
        """Claim up to each rule's limit of due keys; NotLeaderError if the lease is lost.
        ``item_rules`` maps each rule with items to its items max: their claims get
        their items. A rule in the shard's paused set claims none, whatever its limit.
        The rules in ``fair`` (store/fair_args.py) are claimed in fair order between
        their groups (store/lua/_fair.lua)."""
        keys = [shard.leader, shard.meta, shard.seq, shard.next_wake, shard.nodes,
                shard.paused]
        args: list[Any] = [leader, claim_lease_ms, sleep_cap_ms, node_id]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args.append(limit)
        args += self._sections(shard, item_rules, fair, [rule for rule, _ in limits])
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

    def _sections(self, shard: ShardKeys, item_rules: Mapping[str, int],
                  fair: Mapping[str, FairSpec], names: Sequence[str]) -> list[Any]:
        """The items and fair sections of a claiming script's arguments (store/fair_args.py;
        a fair section always comes after an items section)."""
        section = fair_section(shard, fair, names, cluster=isinstance(self._redis, RedisCluster))
        items = _items_section(shard, item_rules, names)
        if section and not items:
            items = [shard.items_prefix, shard.claimed_prefix, *(0 for _ in names)]
        return items + section

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

    async def adopt(self, shard: ShardKeys, *, node_id: str, claim_lease_ms: int,
                    limits: Sequence[tuple[str, int]],
                    item_rules: Mapping[str, int] = NO_ITEM_RULES,
                    fair: Mapping[str, FairSpec] = NO_FAIR) -> AdoptBatch:
        """Claim due keys of rules the shard's leader lacks, where this node serves them
        (``fair`` rules in fair order, their caps checked, as ``claim``)."""
        keys = [shard.leader, shard.meta, shard.seq, shard.nodes, shard.rules, shard.paused]
        args: list[Any] = [node_id, claim_lease_ms]
        for rule, limit in limits:
            keys += [shard.due(rule), shard.inflight(rule)]
            args += [rule, limit]
        args += self._sections(shard, item_rules, fair, [rule for rule, _ in limits])
        now, due, expiry, claims, blocked, served, *rest = await self._claiming(
            "adopt", shard, keys, args, limits)
        return AdoptBatch(int(now), _optional(due), _optional(expiry),
                          _claims(claims, rest[1] if len(rest) > 1 else ()),
                          bool(int(blocked)), int(served), _held(rest[0]) if rest else {})

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

    async def take_rate(self, bucket: str, rate: RateLimit, want: int,
                        give_back: int = 0) -> RateGrant:
        """Take up to ``want`` refresh starts from a rule's rate ``bucket``, after giving
        back ``give_back`` taken and not used."""
        granted, wait = await self._run("take_rate", [bucket], [
            rate.count, round(rate.per * 1000), rate.burst, want, give_back])
        return RateGrant(int(granted), int(wait))

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
