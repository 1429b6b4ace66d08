"""What the fair order costs the write and claim scripts: the Redis time of each call,
``fair`` and plain due order side by side call by call on one valkey-server of its own.
Each call's own execution time comes from SLOWLOG (logging every command), so the
machine's drift, which moves whole runs by a quarter, falls on both sides alike. Shapes:

- ``one tenant``: 50,000 due keys of one tenant (an import), written 500 a call;
- ``one tenant, 20,000 due later``: the same, with 20,000 more keys of the rule due a
  minute later (most of a busy rule's pending keys are due later: the fair order must
  not read them);
- ``four tenants``: 12,500 due keys each, interleaved (equal tenants).

Each side's keys are then claimed 32 a call (a node's batch at the default concurrency),
the two sides' calls alternating, each side first every other time. Prints per shape
the median Redis time of a write call and of a claim call on each side, and fair over
plain.

    .venv/bin/python -m bench.fair_claim_cost [DIR]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from redis.asyncio import Redis

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store.fair_args import FairSpec
from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from .valkey import Server

N, LATER, WRITE, LIMIT = 50_000, 20_000, 500, 32
RULE = "t"
BY_ORG = FairSpec(lua_pattern(KeyPattern.compile("t:{org}:{id}"), "org"), 0, "", 0)
T = TypeVar("T")


@dataclass(frozen=True)
class Shape:
    """The keys both sides write: ``tenants`` tenants, ``N`` due keys in all, interleaved,
    and ``later`` more keys due a minute later."""

    tenants: int = 1
    later: int = 0

    def keys(self) -> list[str]:
        per = N // self.tenants
        return [f"t:g{j}:{i}" for i in range(per) for j in range(self.tenants)]


SHAPES = {"one tenant": Shape(), f"one tenant, {LATER:,} due later": Shape(later=LATER),
          "four tenants": Shape(tenants=4)}


@dataclass
class Side:
    """One side of a comparison: a shard of its own on the shared server."""

    fair: bool
    shard: ShardKeys
    leader: str = ""
    writes: list[int] = field(default_factory=list)  # µs a call
    claims: list[int] = field(default_factory=list)
    claimed: int = 0


class Timer:
    """Runs one script call at a time and reads its execution time from SLOWLOG."""

    def __init__(self, r: Redis) -> None:
        self.r = r

    async def setup(self) -> None:
        await self.r.config_set("slowlog-log-slower-than", 0)
        await self.r.config_set("slowlog-max-len", 128)

    async def run(self, call: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        await self.r.slowlog_reset()
        out = await call()
        for entry in await self.r.slowlog_get(8):
            command = entry["command"]
            text = command.decode() if isinstance(command, bytes) else str(command)
            if text.upper().startswith("EVALSHA"):
                return out, int(entry["duration"])
        raise RuntimeError("no script call in SLOWLOG")


def _in_turn(sides: list[Side], n: int) -> list[Side]:
    """The sides in the order of round ``n``: each goes first every other round (the
    call made first measures a few per cent slower, the same script on both sides)."""
    return sides if n % 2 == 0 else sides[::-1]


async def _claim(scripts: Scripts, side: Side, limit: int) -> int:
    batch = await scripts.claim(side.shard, leader=side.leader, node_id="n1",
                                claim_lease_ms=600_000, sleep_cap_ms=1000,
                                limits=[(RULE, limit)], fair={RULE: BY_ORG} if side.fair else {})
    return len(batch.claims)


async def _write(scripts: Scripts, timer: Timer, sides: list[Side], shape: Shape) -> None:
    """Both sides write the same keys, call by call; the later keys are not timed."""
    keys = shape.keys()
    for n, i in enumerate(range(0, len(keys), WRITE)):
        for side in _in_turn(sides, n):
            group = UpsertGroup(RULE, 0, 60_000, keys[i:i + WRITE])
            _, us = await timer.run(partial(scripts.upsert, side.shard, [group]))
            side.writes.append(us)
    later = [f"t:g0:later{i}" for i in range(shape.later)]
    for side in sides:
        for i in range(0, len(later), WRITE):
            await scripts.upsert(side.shard, [UpsertGroup(RULE, 60_000, 60_000,
                                                          later[i:i + WRITE])])


async def compare(server: Server, name: str, shape: Shape, limit: int = LIMIT) -> list[Side]:
    """One shape: the fair side and the plain side, each on a shard of its own, writing
    and claiming call by call in turn. Raises if a side claims fewer keys than are due.
    A claim call before the writes, as a running node's, publishes the fair order."""
    r = Redis.from_url(server.url, decode_responses=True)
    try:
        scripts, timer = Scripts(r), Timer(r)
        await timer.setup()
        sides = [Side(fair, ShardKeys(f"{name}-{'fair' if fair else 'plain'}", 0))
                 for fair in (True, False)]
        for side in sides:
            side.leader = (await scripts.acquire(side.shard, node_id="n1", lease_ms=600_000,
                                                 mine="")).holder
            await _claim(scripts, side, 1)
        await _write(scripts, timer, sides, shape)
        await _claim_all(scripts, timer, sides, limit, len(shape.keys()))
        return sides
    finally:
        await r.flushall()
        await r.aclose()


async def _claim_all(scripts: Scripts, timer: Timer, sides: list[Side], limit: int,
                     due: int) -> None:
    going, n = list(sides), 0
    while going:
        n += 1
        for side in _in_turn(list(going), n):
            got, us = await timer.run(partial(_claim, scripts, side, limit))
            if got == 0:
                going.remove(side)
                continue
            side.claims.append(us)
            side.claimed += got
    for side in sides:
        if side.claimed < due:
            raise RuntimeError(f"{side.shard.namespace}: the claims took {side.claimed:,} of "
                               f"the {due:,} due keys")


async def measure(server: Server) -> dict[str, list[Side]]:
    return {name: await compare(server, f"s{i}", shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


def report(found: dict[str, list[Side]]) -> list[str]:
    lines = []
    for name, (fair, plain) in found.items():
        for what, f, p in (("a write call", fair.writes, plain.writes),
                           ("a claim call", fair.claims, plain.claims)):
            mf, mp = statistics.median(f), statistics.median(p)
            lines.append(f"{name}, {what}: {mf:,.0f} against {mp:,.0f} µs of Redis time "
                         f"(medians of {len(f):,} and {len(p):,} calls): {mf / mp:.2f}x")
    return lines


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        found = asyncio.run(measure(server))
    print("\n".join(report(found)))


if __name__ == "__main__":
    main()
