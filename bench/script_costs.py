"""Redis CPU per key of the upsert, claim and ack scripts, on a fresh server.

    .venv/bin/python -m bench.script_costs [--keys N] [--batch B]

Loads N keys (20,000) through the upsert script, claims them B at a time (1,000), and
acks them B at a time, with the history entry and without; for each step it prints the
server's CPU (``INFO cpu`` user + sys, before and after) divided by the keys. The server
does nothing else meanwhile, so this is the scripts' own cost, without the clients'.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import redis.asyncio

from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.script_types import ClaimedKey, History, UpsertGroup
from coalescer.store.scripts import Scripts

from .valkey import Server

RULE = "r"
NODE = "cost-node"


def _cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _claim_all(scripts: Scripts, shard: ShardKeys, n: int,
                     batch: int) -> list[ClaimedKey]:
    claims: list[ClaimedKey] = []
    while len(claims) < n:
        got = await scripts.claim(shard, leader=f"1|{NODE}", node_id=NODE,
                                  claim_lease_ms=60_000,
                                  sleep_cap_ms=1000, limits=[(RULE, batch)])
        claims += got.claims
    return claims


async def _round(server: Server, n: int, batch: int, history: int) -> dict[str, float]:
    sync = server.client()
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    scripts, shard = Scripts(client), KeySpace(f"cost{history}", 1).shard(0)
    keys = [f"stats:user:{i}" for i in range(n)]
    out: dict[str, float] = {}
    try:
        t0 = _cpu(sync)
        for i in range(0, n, 2000):
            await scripts.upsert(shard, [UpsertGroup(RULE, 0, 1000, keys[i:i + 2000])])
        t1 = _cpu(sync)
        await client.set(shard.leader, f"1|{NODE}")
        claims = await _claim_all(scripts, shard, n, batch)
        t2 = _cpu(sync)
        for i in range(0, n, batch):
            items = [(c.key, c.token, 1, 0) for c in claims[i:i + batch]]
            await scripts.ack(shard, [(RULE, items)], History(NODE, history))
        t3 = _cpu(sync)
        out = {"upsert": t1 - t0, "claim": t2 - t1, "ack": t3 - t2}
    finally:
        await client.aclose()
        sync.close()
    return {step: seconds * 1e6 / n for step, seconds in out.items()}


async def main(n: int, batch: int) -> None:
    with tempfile.TemporaryDirectory() as folder, Server(Path(folder)) as server:
        for history in (1000, 0):
            us = await _round(server, n, batch, history)
            print(f"history {history:>4}: upsert {us['upsert']:.2f}  claim {us['claim']:.2f}  "
                  f"ack {us['ack']:.2f}  µs of Redis CPU per key ({n:,} keys, batches of "
                  f"{batch:,})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    options = parser.parse_args()
    asyncio.run(main(options.keys, options.batch))
