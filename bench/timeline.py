"""How long a key's timeline takes to answer with many keys pending.

    .venv/bin/python -m bench.timeline [--keys N] [--calls C]

One fresh valkey-server; ``N`` - 1 keys (999,999: the default ``limits.pending_keys`` is
1,000,000, and a touch is refused at it) are touched through a coalescer
(``worker=False``, a window of an hour: they all stay pending), then one of them is run
now, claimed and acked once (through the scripts: a key gets its timeline at its first
claim) and gets a full timeline (a re-schedule a call, past the 32 events kept). Then
``Query.timeline(key, at_ms=...)`` (what ``coalescer timeline KEY --at T`` and ``GET
/keys/{key}/timeline`` run) is called ``C`` times (200) one after the other: wall time
per answer, p50/p99/max in ms. The baseline column is ``Query.explain`` of the same key
on the same server in the same run (it reads the key's shard's history too). Target: p99
<= 50 ms. Also the bytes the full timeline takes (MEMORY USAGE).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from coalescer.store.scripts import Scripts

from .common import RULE, SHARD, Sizes, coalescer, key, touch_distinct
from .valkey import Server

CALLS = 200
QUICK_CALLS = 50
TARGET_MS = 50.0
EVENTS = 40  # re-schedules of the measured key: more than a timeline keeps


def _calls(sizes: Sizes) -> int:
    given = getattr(sizes, "timeline_calls", None)
    if given is not None:
        return int(given)
    return QUICK_CALLS if sizes.drain_keys < Sizes().drain_keys else CALLS


def _percentiles(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"p50": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max": ordered[-1]}


async def _timed(calls: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def _claimed_once(c: Any, measured: str) -> None:
    """``measured`` made due now, claimed and acked by a pretend leader's scripts."""
    await c.query.run_now([measured])
    scripts, node = Scripts(c.redis), "bench-timeline"
    await c.redis.set(SHARD.leader, f"1|{node}")
    got = await scripts.claim(SHARD, leader=f"1|{node}", node_id=node, claim_lease_ms=60_000,
                              sleep_cap_ms=1000, limits=[(RULE, 10)])
    await scripts.ack(SHARD, [(RULE, [(cl.key, cl.token, 1, 0) for cl in got.claims])])
    await c.redis.delete(SHARD.leader)


async def _loaded(server: Server, n: int) -> tuple[Any, str]:
    """A started coalescer on ``server`` with ``n`` keys pending, one of them (returned)
    with a full timeline."""
    c = coalescer(server, False, window="1h", max_wait="2h")
    await c.start()
    await touch_distinct(c, [key(i) for i in range(n - 1)])  # limits.pending_keys: n
    await c.flush()
    measured = key(n // 2)
    await _claimed_once(c, measured)
    for i in range(EVENTS):
        c.touch(measured, delay=f"{600 + i}s")
        await c.flush()
    return c, measured


async def answer(server: Server, sizes: Sizes, n: int, what: str = "timeline") -> dict[str, Any]:
    """``what``: "timeline" (the figure) or "explain" (its baseline), timed on one key
    with ``n`` keys pending."""
    c, measured = await _loaded(server, n)
    try:
        at = (await c.query.timeline(measured))["now_ms"] - 1000
        if what == "timeline":
            ms = await _timed(_calls(sizes), lambda: c.query.timeline(measured, at_ms=at))
        else:
            ms = await _timed(_calls(sizes), lambda: c.query.explain(measured))
        info = await c.query.timeline(measured)
        pending = await c.query.status()
        size = await c.redis.memory_usage(SHARD.timeline(measured))
    finally:
        await c.close()
    return {"pending": sum(int(r["pending"]) for r in pending["rules"].values()),
            "events": len(info["events"]), "timeline_bytes": int(size or 0),
            "calls": len(ms), **_percentiles(ms)}


def rows(t: Any) -> None:
    """The table's rows (``bench.run.Rows``): the timeline beside explain."""
    where, base = "timeline.coalescer", "timeline.baseline"
    head = "timeline KEY --at T with 1M keys pending (baseline column: explain KEY)"
    t.figure(f"{head}: answer, p99", t.spread(where, "p99"), t.spread(base, "p99"),
             fmt=lambda v: f"{v:,.1f} ms", target=f"<= {TARGET_MS:g} ms",
             ok=lambda c: c <= TARGET_MS)
    t.figure(f"{head}: answer, p50", t.spread(where, "p50"), t.spread(base, "p50"),
             fmt=lambda v: f"{v:,.1f} ms")
    t.figure("a full timeline (32 events): bytes", t.spread(where, "timeline_bytes"), None,
             fmt=lambda v: f"{v:,.0f} B")


async def main(n: int, calls: int) -> None:
    sizes = Sizes()
    sizes.timeline_calls = calls  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as folder:
        for what in ("timeline", "explain"):
            with Server(Path(folder), what) as server:
                got = await answer(server, sizes, n, what)
            print(f"{what:>8}: p50 {got['p50']:.2f} ms  p99 {got['p99']:.2f} ms  max "
                  f"{got['max']:.2f} ms over {got['calls']} calls, {got['pending']:,} keys "
                  f"pending, {got['events']} events shown, the timeline "
                  f"{got['timeline_bytes']:,} B")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--calls", type=int, default=CALLS)
    options = parser.parse_args()
    asyncio.run(main(options.keys, options.calls))
