"""What the fair order costs the claim script: its Redis time per key claimed, side by
side in one run on a valkey-server of its own, rounds interleaved (each first in turn):
50,000 due keys of one tenant claimed 32 a call (a node's batch at the default
concurrency) by a ``fair`` rule against the same rule without ``fair`` (plain due
order), with no other keys pending and with 20,000 more keys of the rule due a minute
later (most of a busy rule's pending keys are due later: the fair order must not read
them).

    .venv/bin/python -m bench.fair_claim_cost [DIR]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store.fair_args import FairSpec
from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from .valkey import Server, commandstats

N, LATER, ROUNDS = 50_000, 20_000, 4
RULE = "t"
SPEC = FairSpec(lua_pattern(KeyPattern.compile("t:{org}:{id}"), "org"), 0, "", 0)


@dataclass(frozen=True)
class Setup:
    """One side of a comparison."""

    fair: bool = True
    limit: int = 32  # keys a claim call may take
    later: int = 0  # keys of the rule due a minute later


async def _write(scripts: Scripts, shard: ShardKeys, setup: Setup) -> None:
    keys = [f"t:g0:{i}" for i in range(N)]
    for i in range(0, N, 2000):
        await scripts.upsert(shard, [UpsertGroup(RULE, 0, 60_000, keys[i:i + 2000])])
    later = [f"t:g0:later{i}" for i in range(setup.later)]
    for i in range(0, setup.later, 2000):
        await scripts.upsert(shard, [UpsertGroup(RULE, 60_000, 60_000, later[i:i + 2000])])


async def claim_all(server: Server, ns: str, setup: Setup) -> tuple[float, float]:
    """Redis microseconds per due key of the writes, then of the claim calls that drain
    them. A claim call before the writes, as a running node's, publishes the order."""
    shard = ShardKeys(ns, 0)
    r = Redis.from_url(server.url, decode_responses=True)
    scripts = Scripts(r)
    leader = (await scripts.acquire(shard, node_id="n1", lease_ms=60_000, mine="")).holder

    async def claim() -> int:
        batch = await scripts.claim(shard, leader=leader, node_id="n1", claim_lease_ms=60_000,
                                    sleep_cap_ms=1000, limits=[(RULE, setup.limit)],
                                    fair={RULE: SPEC} if setup.fair else {})
        return len(batch.claims)

    sync = server.client()
    await claim()
    sync.config_resetstat()
    await _write(scripts, shard, setup)
    write_usec = commandstats(sync, "usec").get("evalsha", 0)
    sync.config_resetstat()
    claimed = 0
    while claimed < N and (got := await claim()):
        claimed += got
    usec = commandstats(sync, "usec").get("evalsha", 0)
    sync.flushall()  # the next run starts on an empty server, as this one did
    sync.close()
    await r.aclose()
    if claimed < N:
        raise RuntimeError(f"{ns}: the claims took {claimed:,} of the {N:,} due keys")
    return write_usec / N, usec / claimed


COMPARISONS: dict[str, tuple[Setup, Setup]] = {
    "fair over plain, no key due later": (Setup(), Setup(fair=False)),
    f"fair over plain, {LATER:,} keys due later": (Setup(later=LATER),
                                                    Setup(fair=False, later=LATER)),
}


Found = tuple[list[tuple[float, float]], list[tuple[float, float]]]


async def measure(server: Server) -> dict[str, Found]:
    out: dict[str, Found] = {}
    for name, (a, b) in COMPARISONS.items():
        found: Found = ([], [])
        for n in range(ROUNDS):
            order = (0, 1) if n % 2 == 0 else (1, 0)
            for side in order:
                found[side].append(await claim_all(server, f"r{n}{side}", (a, b)[side]))
        out[name] = found
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        found = asyncio.run(measure(server))
    for name, (a, b) in found.items():
        for what, i in (("the claims", 1), ("the writes", 0)):
            mine, plain = min(x[i] for x in a), min(x[i] for x in b)
            print(f"{name}, {what}: {mine:.2f} against {plain:.2f} µs of Redis time per "
                  f"due key (best of {ROUNDS}): {mine / plain:.2f}x")


if __name__ == "__main__":
    main()
