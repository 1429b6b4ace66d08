"""Batch handlers: a drain with a no-op batch handler, beside the per-key drain.

``drain_batch``: N keys due at once, a worker whose rule says ``batch: {max: 500}``
(default concurrency 16, counting batches) and whose handler does nothing; keys/s from
the first handler call to the last ack, with the Redis work per key (time inside the
scripts, from INFO commandstats) and the Python CPU per key. ``drain`` in bench/run.py
is the per-key figure of the same workload.

``stats_app``: the statistics example (examples/stats_app) after a bulk import: N
customers (10,000) with orders in SQLite, each touched once, refreshed by the per-key
handler (one query and one transaction a customer, default concurrency) or by the batch
handler (``batch: {max: 500}``: one ``GROUP BY ... WHERE customer_id IN (...)`` query and
one transaction a batch); keys/s from the first refresh to the last row written.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from coalescer import Claim, Coalescer, Config
from examples.stats_app import customer_stats as stats_db

from . import common as C
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
    text = C.rules_text(handler="bench.batches:refresh_batch", **kw)
    return Config.from_string(text + f"    batch: {{max: {size}}}\n", source="<bench>")


async def drain_batch(server: Server, sizes: C.Sizes, size: int = BATCH) -> dict[str, Any]:
    n = sizes.drain_keys
    keys = [C.key(i) for i in range(n)]
    kw = {"window": "100ms", "max_wait": "1s", "concurrency": F.DEFAULT_CONCURRENCY}
    async with C.coalescer(server, False, **kw) as w:
        await C.touch_distinct(w, keys)
        await w.flush()
    await asyncio.sleep(0.3)  # every key is due
    SEEN.reset()
    node = Coalescer(batch_config(size, **kw), redis_url=server.url, worker=True,
                     node_id="bench-node")
    async with node as c:
        deadline = time.monotonic() + 120
        while SEEN.claims == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        cpu, counted, t_cpu = C.CpuMeter(server), SEEN.claims, time.time()
        # Polled every millisecond: the whole drain takes a few hundred (the per-key
        # drain's 20 ms polls would be a tenth of it).
        settled = C.coalescer_settled(c)
        while not await settled() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        t_acked = time.time()
        used = cpu.done(t_acked - t_cpu, n - counted)
    first = SEEN.first or t_acked
    return {"keys": n, "batch": size, "concurrency": F.DEFAULT_CONCURRENCY,
            "refreshed": SEEN.claims, "calls": SEEN.calls,
            "per_second": n / max(1e-9, t_acked - first), "drain_seconds": t_acked - first,
            "redis_us_per_key": used["redis_command_us_per_item"],
            "python_us_per_key": used["python_us_per_item"], "cpu": used}


STATS_HANDLERS = {"per_key": "examples.stats_app.customer_stats:refresh_customer",
                  "batch": "examples.stats_app.customer_stats:refresh_customers"}
STATS_CUSTOMERS = 10_000
DUE_AFTER = 2.0  # seconds from the bulk import's touches to the keys' due time


def stats_config(kind: str) -> Config:
    text = C.rules_text(handler=STATS_HANDLERS[kind], window="100ms", max_wait="1s",
                        concurrency=F.DEFAULT_CONCURRENCY).replace("{user_id}", "{customer_id}")
    if kind == "batch":
        text += f"    batch: {{max: {BATCH}}}\n"
    return Config.from_string(text, source="<bench>")


async def stats_app(server: Server, sizes: C.Sizes, tmp: Path, kind: str) -> dict[str, Any]:
    """Refresh every customer of a fresh stats database after a bulk import."""
    n = STATS_CUSTOMERS if sizes.drain_keys >= 50_000 else STATS_CUSTOMERS // 5
    db = tmp / f"stats-{kind}-{time.monotonic_ns()}.db"
    os.environ[stats_db.DB_ENV] = str(db)
    stats_db.init_db(db)
    conn = stats_db.connect(db)
    try:
        stats_db.add_orders(conn, [(i % n, 100 + i % 997) for i in range(n * 5)])
        keys = [C.key(i) for i in range(n)]
        async with C.coalescer(server, False, window=f"{DUE_AFTER}s",
                               max_wait=f"{2 * DUE_AFTER}s") as w:
            t_start = time.time() + DUE_AFTER  # every key falls due then (at the latest)
            await C.touch_distinct(w, keys)
            await w.flush()
        node = Coalescer(stats_config(kind), redis_url=server.url, worker=True,
                         node_id="bench-node")
        async with node:  # started (its process pool too) before the keys fall due
            deadline = time.monotonic() + 120
            while stats_db.refreshes_since(conn, 0) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        first, last = conn.execute("SELECT MIN(at), MAX(at) FROM refresh_log").fetchone()
        t_done = last / 1000 if last is not None else time.time()
        done = stats_db.refreshes_since(conn, 0)
        wrong = len(stats_db.mismatches(conn))
    finally:
        conn.close()
    # From the moment every key is due (the node started before it, so its start-up,
    # a process pool's included, is not counted) to the last row written.
    seconds = max(1e-3, t_done - t_start)
    return {"customers": n, "handler": kind, "refreshed": done, "mismatches": wrong,
            "seconds": seconds, "per_second": done / seconds,
            "first_to_last_row_s": (last - first) / 1000 if first is not None else None}
