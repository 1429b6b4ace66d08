"""Batch handlers: a drain with a no-op batch handler, beside the per-key drain.

``drain_batch``: N keys due at once, a worker whose rule says ``batch: {max: 500}``
(default concurrency 16, counting batches) and whose handler does nothing; keys/s from
the first handler call to the last ack, with the Redis work per key (time inside the
scripts, from INFO commandstats) and the Python CPU per key. ``drain`` in bench/run.py
is the per-key figure of the same workload.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from coalescer import Claim, Coalescer, Config

from . import figures as F
from .valkey import Server

BATCH = 500


class Count:
    """What the no-op batch handler saw: claims, calls, first and last call (time.time)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.claims = 0
        self.calls = 0
        self.first: float | None = None
        self.last: float | None = None


SEEN = Count()


async def refresh_batch(claims: list[Claim]) -> None:
    """A no-op batch handler: count what it was given."""
    now = time.time()
    if SEEN.first is None:
        SEEN.first = now
    SEEN.last = now
    SEEN.calls += 1
    SEEN.claims += len(claims)


def batch_config(size: int, **kw: Any) -> Config:
    text = F.rules_text(handler="bench.batches:refresh_batch", **kw)
    return Config.from_string(text + f"    batch: {{max: {size}}}\n", source="<bench>")


async def drain_batch(server: Server, sizes: F.Sizes, size: int = BATCH) -> dict[str, Any]:
    n = sizes.drain_keys
    keys = [F.key(i) for i in range(n)]
    kw = {"window": "100ms", "max_wait": "1s", "concurrency": F.DEFAULT_CONCURRENCY}
    async with F.coalescer(server, False, **kw) as w:
        await F._touch_distinct(w, keys)
        await w.flush()
    await asyncio.sleep(0.3)  # every key is due
    SEEN.reset()
    node = Coalescer(batch_config(size, **kw), redis_url=server.url, worker=True,
                     node_id="bench-node")
    async with node as c:
        deadline = time.monotonic() + 120
        while SEEN.claims == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        cpu, counted, t_cpu = F.CpuMeter(server), SEEN.claims, time.time()
        while SEEN.claims < n and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await F.settle(F.coalescer_settled(c), timeout=30, stable=0.0)
        t_acked = time.time()
        used = cpu.done(t_acked - t_cpu, n - counted)
    first = SEEN.first or t_acked
    return {"keys": n, "batch": size, "concurrency": F.DEFAULT_CONCURRENCY,
            "refreshed": SEEN.claims, "calls": SEEN.calls,
            "per_second": n / max(1e-9, t_acked - first), "drain_seconds": t_acked - first,
            "redis_us_per_key": used["redis_command_us_per_item"],
            "python_us_per_key": used["python_us_per_item"], "cpu": used}
