"""Touches with items into Redis, beside plain touches of the same run.

``items_coalescer``: one process, one write-path coalescer (``worker=False``) whose rule
says ``items: {max: 1000}``: ``items_keys`` customers (10,000) each touched with
``items_per_key`` distinct items (20 orders: 200,000 items), interleaved as a bulk import
of orders writes them (customer 0, 1, ..., then their second orders, ...), from one loop
that yields every 1,000 touches so the flusher writes meanwhile; items/s from the first
touch until ``flush`` returns (Redis then holds every item in its key's items set,
counted after the clock stops), with the CPU per item. The plain figures of the same
run are bench/figures.py's: ``hot_key`` (touch() calls/s of one key) and ``distinct``
(distinct keys/s into Redis), measured in this group beside it.
"""

from __future__ import annotations

import time
from typing import Any

from coalescer import Coalescer, Config

from . import common as C
from .valkey import Server

ITEMS_MAX = 1000


def items_config(**kw: Any) -> Config:
    text = C.rules_text(**kw).replace(
        "    handler: bench.probe:refresh\n",
        f"    handler: bench.probe:refresh\n    items: {{max: {ITEMS_MAX}}}\n")
    return Config.from_string(text, source="<bench>")


async def items_coalescer(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    """Items/s into Redis from one process."""
    keys = [C.key(i) for i in range(sizes.items_keys)]
    total = len(keys) * sizes.items_per_key
    c = Coalescer(items_config(window="1h", max_wait="2h"), redis_url=server.url,
                  worker=False, node_id="bench-node")
    async with c:
        cpu = C.CpuMeter(server)
        t0 = time.perf_counter()
        rounds = range(sizes.items_per_key)  # each key with its items, round by round
        refused = await C.touch_distinct(c, [k for _ in rounds for k in keys],
                                         [f"order:{i}-{j}" for j in rounds
                                          for i in range(len(keys))])
        touched = time.perf_counter() - t0
        await c.flush()
        dt = time.perf_counter() - t0
        used = cpu.done(dt, total)
        held = await _items_held(c, keys)
    return {"items": total, "keys": len(keys), "seconds": dt, "per_second": total / dt,
            "touch_loop_seconds": touched, "backpressure_refusals": refused,
            "redis_holds": held, "cpu": used}


async def _items_held(c: Coalescer, keys: list[str]) -> int:
    pipe = c.redis.pipeline(transaction=False)
    for k in keys:
        pipe.scard(C.SHARD.items(k))
    return sum(int(n) for n in await pipe.execute())
