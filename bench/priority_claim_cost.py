"""What reading the keys' priorities costs the fair order's claims: the Redis time of
the claim script over 50,000 due keys of 50 tenants (claimed 500 a call, till none is
left), with the script as it is and with its priority read (one HMGET a sweep) taken
out, side by side in one run on a valkey-server of its own.

    .venv/bin/python -m bench.priority_claim_cost [DIR]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from redis.asyncio import Redis

from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.store import script_calls
from coalescer.store.fair_args import FairSpec
from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from .valkey import Server, commandstats

N, GROUPS, LIMIT, ROUNDS = 50_000, 50, 500, 4
RULE = "t"
SPEC = FairSpec(lua_pattern(KeyPattern.compile("t:{org}:{id}"), "org"), 0, "", 0)
# The script as it was before keys had priorities of their own: the rule's offset only
WITHOUT = {"local by, order, prios = {}, {}, fair_prios(f, got)": "local by, order = {}, {}",
           "tonumber(got[i + 1]) - prios[(i + 1) / 2]": "tonumber(got[i + 1]) - f.prio"}


def _without_read(name: str, source: str) -> str:
    if name not in ("claim", "adopt"):
        return source
    for old, new in WITHOUT.items():
        assert old in source, old
        source = source.replace(old, new)
    return source


async def claim_all(server: Server, ns: str, *, read: bool) -> float:
    """Redis microseconds of the claim calls that drain the keys, per key claimed."""
    original = script_calls.script_source
    if not read:
        script_calls.script_source = lambda name: _without_read(name, original(name))
    try:
        r = Redis.from_url(server.url, decode_responses=True)
        scripts, shard = Scripts(r), ShardKeys(ns, 0)
    finally:
        script_calls.script_source = original
    keys = [f"t:g{i % GROUPS}:{i}" for i in range(N)]
    for i in range(0, N, 2000):
        await scripts.upsert(shard, [UpsertGroup(RULE, 0, 60_000, keys[i:i + 2000])])
    leader = (await scripts.acquire(shard, node_id="n1", lease_ms=60_000, mine="")).holder
    sync = server.client()
    sync.config_resetstat()
    claimed = 0
    while claimed < N:
        batch = await scripts.claim(shard, leader=leader, node_id="n1", claim_lease_ms=60_000,
                                    sleep_cap_ms=1000, limits=[(RULE, LIMIT)],
                                    fair={RULE: SPEC})
        if not batch.claims:
            break
        claimed += len(batch.claims)
    usec = commandstats(sync, "usec").get("evalsha", 0)
    sync.flushall()  # the next run starts on an empty server, as this one did
    sync.close()
    await r.aclose()
    return usec / max(claimed, 1)


async def measure(server: Server) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"with the read": [], "without it": []}
    for n in range(ROUNDS):  # interleaved, each first in turn: the load falls on both
        for read in (True, False) if n % 2 == 0 else (False, True):
            name = "with the read" if read else "without it"
            out[name].append(await claim_all(server, f"r{n}{int(read)}", read=read))
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        found = asyncio.run(measure(server))
    best = {name: min(v) for name, v in found.items()}
    for name, value in best.items():
        print(f"claim script, {name}: {value:.2f} µs of Redis time per key claimed "
              f"(best of {ROUNDS})")
    print(f"ratio: {best['with the read'] / best['without it']:.2f}")


if __name__ == "__main__":
    main()
