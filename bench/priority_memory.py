"""Bytes per pending key with and without a touch's priority: 100,000 keys written by
the upsert script as touches write them, once plainly and once each with a priority
(30 s, and the largest, 366 days), on a valkey-server of its own.

    .venv/bin/python -m bench.priority_memory [DIR]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from redis.asyncio import Redis

from coalescer.store.keys import ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from .valkey import Server, used_memory

N = 100_000
CALL = 2000  # keys per upsert call, as the writer sends them
PRIORITIES = {"plain": None, "priority 30s": 30_000, "priority 366d": 366 * 86_400_000}


async def _fill(scripts: Scripts, shard: ShardKeys, keys: list[str], ms: int | None) -> None:
    for i in range(0, len(keys), CALL):
        part = keys[i:i + CALL]
        times = {k: f"p{ms}" for k in part} if ms is not None else None
        await scripts.upsert(shard, [UpsertGroup("stats", 60_000, 120_000, part,
                                                 schedules=times)])


async def measure(server: Server) -> dict[str, float]:
    """Bytes of used_memory per pending key, by what its touches carried."""
    sync, r = server.client(), Redis.from_url(server.url, decode_responses=True)
    scripts, out = Scripts(r), {}
    for n, (name, ms) in enumerate(PRIORITIES.items()):
        shard = ShardKeys(f"mem{n}", 0)
        await _fill(scripts, shard, ["stats:user:warm"], ms)  # the shard's keys exist
        before = used_memory(sync)
        await _fill(scripts, shard, [f"stats:user:{i}" for i in range(N)], ms)
        out[name] = (used_memory(sync) - before) / N
    await r.aclose()
    sync.close()
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    with Server(root) as server:
        found = asyncio.run(measure(server))
    for name, per_key in found.items():
        print(f"{name}: {per_key:.1f} B per pending key ({N:,} keys)")


if __name__ == "__main__":
    main()
