"""A fair rule's weights and cap changed at runtime, without a restart.

The namespace's hash (``keys.fair_settings``) is what the operator reads; the claim
script reads each shard's copy (``ShardKeys.fair(rule) + "conf"``, in the shard's own
slot, as the paused rules are copied), in the same step as it claims, so a change
holds for every node's next claim once it returns. Fields: ``w:VALUE`` -> the weight
of that value of the capture, ``cap`` -> max_running (``0``: no cap). A field that is
absent leaves the rules file's setting in force."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster

from coalescer.store import keys as key_names
from coalescer.store.keys import ShardKeys

NO_CAP = 0  # the stored cap that lifts the rules file's max_running


@dataclass(frozen=True, slots=True)
class FairOverrides:
    """The runtime settings of one fair rule: weights by value, and the cap (None: the
    rules file's; ``NO_CAP``: none)."""

    weights: dict[str, float] = field(default_factory=dict)
    cap: int | None = None

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> FairOverrides:
        weights: dict[str, float] = {}
        cap = None
        for raw_name, raw_value in raw.items():
            name, value = _text(raw_name), _text(raw_value)
            if name == "cap":
                cap = int(value)
            elif name.startswith("w:"):
                weights[name[2:]] = float(value)
        return cls(weights=weights, cap=cap)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_overrides(redis: Any, namespace: str, rule: str) -> FairOverrides:
    """The runtime settings of ``rule`` (empty when none were set)."""
    return FairOverrides.from_hash(await redis.hgetall(key_names.fair_settings(namespace, rule)))


@dataclass(frozen=True, slots=True)
class FairChange:
    """What an operator changes: ``weights`` set, ``cap`` set (None: left), and
    ``reset``: every runtime setting dropped first (the rules file's hold again)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    cap: int | None = None
    reset: bool = False


async def write_overrides(redis: Any, namespace: str, shards: Sequence[ShardKeys], rule: str,
                          change: FairChange) -> None:
    """Apply ``change`` to ``rule``'s settings in the namespace's hash and in every copy
    of ``shards``, in one round trip."""
    fields = {f"w:{value}": repr(float(w)) for value, w in change.weights.items()}
    if change.cap is not None:
        fields["cap"] = str(change.cap)
    reset = change.reset
    pipe = redis.pipeline(transaction=False)
    pipe.sadd(key_names.fair_settings_rules(namespace), rule)
    for name in [key_names.fair_settings(namespace, rule),
                 *(shard.fair(rule) + "conf" for shard in shards)]:
        if reset:
            pipe.delete(name)
        if fields:
            pipe.hset(name, mapping=fields)
    await pipe.execute()


async def copy_overrides(redis: Any, namespace: str, shards: Sequence[ShardKeys]) -> None:
    """Give ``shards`` (new ones: a reshard to more shards) every rule's runtime
    settings."""
    rules = [_text(r) for r in await redis.smembers(key_names.fair_settings_rules(namespace))]
    pipe = redis.pipeline(transaction=False)
    found = False
    for rule in sorted(rules):
        raw = await redis.hgetall(key_names.fair_settings(namespace, rule))
        if not raw:
            continue
        found = True
        for shard in shards:
            pipe.hset(shard.fair(rule) + "conf", mapping=raw)
    if found:
        await pipe.execute()


async def record_in_flight(redis: Any, namespace: str, shards: Sequence[ShardKeys], rule: str,
                           group_of: Callable[[str], str | None]) -> int:
    """Put ``rule``'s claims in flight into their groups' run sets (the claim script
    records only the claims it makes under a cap): a cap set at runtime counts the runs
    already going. Entries of runs that end meanwhile are dropped by the next claim that
    reads them. Returns how many runs were found."""
    cluster = isinstance(redis, RedisCluster)
    pipe = redis.pipeline(transaction=False)
    for shard in shards:
        pipe.zrange(shard.inflight(rule), 0, -1)
    found = await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    runs = 0
    for shard, raw in zip(shards, found, strict=True):
        prefix = (shard.fair(rule) + "run:" if cluster
                  else key_names.fair_runs(namespace, rule))
        for key, token in await _running(redis, shard, [_text(k) for k in raw]):
            group = group_of(key)
            if group is not None:
                pipe.hset(prefix + group, key, f"{token}|{shard.meta}")
                runs += 1
    if runs:
        await pipe.execute()
    return runs


async def _running(redis: Any, shard: ShardKeys, keys: list[str]) -> list[tuple[str, int]]:
    """The keys of ``keys`` running in ``shard``, each with its claim's token."""
    if not keys:
        return []
    states = await redis.hmget(shard.meta, keys)
    pairs = [(key, _token(state)) for key, state in zip(keys, states, strict=True)]
    return [(key, token) for key, token in pairs if token is not None]


def _token(state: Any) -> int | None:
    """The fencing token of a running state ("R|TOKEN|..."), else None."""
    if state is None:
        return None
    parts = _text(state).split("|", 2)
    return int(parts[1]) if parts[0] == "R" and len(parts) > 1 and parts[1].isdigit() else None
