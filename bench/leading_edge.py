"""Figures of ``edge: leading`` beside ``edge: trailing`` on the same workload.

``bursts``: one in-process node at the default concurrency (16) and absorb (50 ms),
window 200 ms, max_wait 2 s. ``leading_bursts`` keys (600; quick 300) each get one
burst of 5 touches 20 ms apart, the bursts starting 200 a second, one after the
other. Measured in this process (one clock): each burst's first refresh start after
its first ``touch()`` call (p50/p99/max, ms), the refreshes per burst (a leading rule:
the leading one and one trailing one for the touches after it started, so 2), lost
updates (a touch with no refresh started after it) and Redis CPU per touch (``INFO
cpu`` over the touches and their refreshes). The baseline column is the same workload
on a trailing rule, in the same run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from typing import Any

from coalescer import Claim, Coalescer
from coalescer.config.rules import Config

from . import common as C
from .valkey import Server

WINDOW_MS = 200
MAX_WAIT = "2s"
TOUCHES = 5  # a burst's touches
GAP_S = 0.020  # between a burst's touches
RATE = 200  # bursts started a second
BURSTS = 600
QUICK_BURSTS = 300
RULE = "r"

STARTS: dict[str, list[float]] = defaultdict(list)  # key -> perf_counter at each start


async def record(claim: Claim) -> None:
    """The bench's handler: notes when each refresh started."""
    STARTS[claim.key].append(time.perf_counter())


def bursts_of(sizes: C.Sizes) -> int:
    """The bursts of a run: ``sizes.leading_bursts`` when set, fewer in a quick run."""
    given = getattr(sizes, "leading_bursts", None)
    if given is not None:
        return int(given)
    return QUICK_BURSTS if sizes.drain_keys < C.Sizes().drain_keys else BURSTS


def rules(edge: str) -> Config:
    return Config.from_string(f"""\
namespace: {C.NS}
rules:
  - name: {RULE}
    match: "stats:user:{{user_id}}"
    window: {WINDOW_MS}ms
    max_wait: {MAX_WAIT}
    edge: {edge}
    handler: bench.leading_edge:record
""", source="<bench>")


def _schedule(n: int) -> list[tuple[float, str, bool]]:
    """(seconds from the start, key, first of its burst) for every touch, in order."""
    events = [(i / RATE + j * GAP_S, C.key(i), j == 0) for i in range(n) for j in range(TOUCHES)]
    return sorted(events)


async def bursts(server: Server, sizes: C.Sizes, edge: str) -> dict[str, Any]:
    """One burst per key on a rule with ``edge``; see the module's docstring."""
    STARTS.clear()
    n = bursts_of(sizes)
    first: dict[str, float] = {}
    touched: dict[str, list[float]] = defaultdict(list)
    async with Coalescer(rules(edge), redis_url=server.url, worker=True,
                         node_id="bench-node") as c:
        await asyncio.sleep(0.3)  # leadership taken
        meter = C.CpuMeter(server)
        t0 = time.perf_counter()
        for at, key, is_first in _schedule(n):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            c.touch(key)
            touched[key].append(now)
            if is_first:
                first[key] = now
        await c.flush()
        await C.settle(_settled(c, n), timeout=30.0)
        cpu = meter.done(time.perf_counter() - t0, n * TOUCHES)
    return _figures(first, touched, cpu)


def _settled(c: Coalescer, n: int) -> Any:
    async def check() -> bool:
        r = c.redis
        due, inflight = await asyncio.gather(r.zcard(C.SHARD.due(RULE)),
                                             r.zcard(C.SHARD.inflight(RULE)))
        return due + inflight == 0 and len(STARTS) == n
    return check


def _figures(first: dict[str, float], touched: dict[str, list[float]],
             cpu: dict[str, Any]) -> dict[str, Any]:
    lags = [(STARTS[k][0] - t) * 1000 for k, t in first.items() if STARTS.get(k)]
    runs = [len(STARTS.get(k, [])) for k in first]
    lost = sum(1 for k, times in touched.items()
               if not STARTS.get(k) or max(STARTS[k]) < max(times))
    out = C.percentiles(lags)
    out.update(bursts=len(first), runs_max=max(runs), runs_mean=statistics.fmean(runs),
               lost=lost, redis_cpu_us_per_touch=cpu["redis_cpu_us_per_item"], cpu=cpu)
    return out


def rows(t: Any) -> None:
    """The table's rows (``bench.run.Rows``): leading beside trailing."""
    where, base = "leading.coalescer", "leading.baseline"
    head = "edge: leading beside trailing (window 200 ms, bursts of 5 touches over 80 ms)"
    t.figure(f"{head}: first refresh start after the burst's first touch, p99",
             t.spread(where, "p99"), t.spread(base, "p99"),
             fmt=lambda v: f"{v:,.1f} ms", target="<= 10 ms", ok=lambda c: c <= 10.0)
    t.figure(f"{head}: first refresh start after the first touch, p50",
             t.spread(where, "p50"), t.spread(base, "p50"), fmt=lambda v: f"{v:,.1f} ms")
    t.figure(f"{head}: refreshes per burst, most", t.spread(where, "runs_max"),
             t.spread(base, "runs_max"), fmt=lambda v: f"{v:g}", target="<= 2",
             ok=lambda c: c <= 2)
    t.figure(f"{head}: Redis CPU per touch", t.spread(where, "redis_cpu_us_per_touch"),
             t.spread(base, "redis_cpu_us_per_touch"), fmt=lambda v: f"{v:,.1f} us")
    t.figure(f"{head}: touches with no refresh started after them",
             t.spread(where, "lost"), t.spread(base, "lost"), fmt=lambda v: f"{v:g}",
             target="0", ok=lambda c: c == 0)
