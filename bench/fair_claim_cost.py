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


async def claim_all(server: Server, ns: str, setup: Setup) -> float:
    """Redis microseconds of the claim calls that drain the due keys, per key claimed."""
    shard = ShardKeys(ns, 0)
    r = Redis.from_url(server.url, decode_responses=True)
    scripts = Scripts(r)
    await _write(scripts, shard, setup)
    leader = (await scripts.acquire(shard, node_id="n1", lease_ms=60_000, mine="")).holder
    sync = server.client()
    sync.config_resetstat()
    claimed = 0
    while claimed < N:
        batch = await scripts.claim(shard, leader=leader, node_id="n1", claim_lease_ms=60_000,
                                    sleep_cap_ms=1000, limits=[(RULE, setup.limit)],
                                    fair={RULE: SPEC} if setup.fair else {})
        if not batch.claims:
            break
        claimed += len(batch.claims)
    usec = commandstats(sync, "usec").get("evalsha", 0)
    sync.flushall()  # the next run starts on an empty server, as this one did
    sync.close()
    await r.aclose()
    if claimed < N:
        raise RuntimeError(f"{ns}: the claims took {claimed:,} of the {N:,} due keys")
    return usec / claimed


COMPARISONS: dict[str, tuple[Setup, Setup]] = {
    "fair over plain, no key due later": (Setup(), Setup(fair=False)),
    f"fair over plain, {LATER:,} keys due later": (Setup(later=LATER),
                                                    Setup(fair=False, later=LATER)),
}


async def measure(server: Server) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for name, (a, b) in COMPARISONS.items():
        found: tuple[list[float], list[float]] = ([], [])
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
        print(f"{name}: {min(a):.2f} against {min(b):.2f} µs of Redis time per key "
              f"claimed (best of {ROUNDS}): {min(a) / min(b):.2f}x")


if __name__ == "__main__":
    main()
