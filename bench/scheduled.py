"""The ``scheduled`` group: keys touched with a time of their own (``at``), beside the
baseline design's ZSET of due times, on the same sizes.

Each run schedules ``sizes.million`` keys at random times from 1 hour to 30 days ahead
and reads what Redis holds for them (``used_memory`` before and after: bytes per key),
then, with those keys still waiting, schedules a slice of ``SLICE_RATE`` keys a second
for ``SLICE_SECONDS``, the first due ``LEAD`` seconds later, and measures each slice
key's start lag (refresh start minus its scheduled time, on one clock) on one worker
node (concurrency 256, as the lag groups' tuned figure). The baseline adds the same
due times to its ZSET (``ZADD``), and its worker polls as it always does.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from bench import common as C
from bench import figures as F
from bench import probe
from bench.baseline import Baseline
from bench.probe import REC
from bench.valkey import Server, used_memory
from coalescer import BackpressureError, Coalescer
from coalescer.errors import QuotaExceededError

SLICE_RATE = 1000  # slice keys falling due per second
SLICE_SECONDS = 10.0
LEAD = 3.0  # seconds from the end of the slice's scheduling to its first due time
DAY = 86_400.0


def far_times(n: int, days: int = 30, seed: int = 27) -> list[float]:
    """Epoch seconds from 1 hour to ``days`` days ahead, seeded."""
    rng = random.Random(seed)
    now = time.time()
    return [now + rng.uniform(3600.0, days * DAY) for _ in range(n)]


async def schedule(c: Coalescer, keys: list[str], times: list[float]) -> None:
    """``touch(key, at=...)`` each key, yielding every 1000 so the flusher writes, and
    waiting while the writer catches up; a quota refusal stops the run (a bench must not
    crawl on retries), and so does a buffer still full after 60 s."""
    touch = c.touch
    for i, (k, at) in enumerate(zip(keys, times, strict=True)):
        for _ in range(60_000):  # bounded: back-pressure only while Redis catches up
            try:
                touch(k, at=at)
                break
            except QuotaExceededError:
                raise
            except BackpressureError:
                await asyncio.sleep(0.001)
        else:
            raise TimeoutError(f"the touch buffer stayed full for 60 s at key {i} of {len(keys)}")
        if i % 1000 == 999:
            await asyncio.sleep(0)


def slice_due(n: int) -> tuple[list[str], list[float]]:
    """``SLICE_RATE`` keys a second for ``SLICE_SECONDS`` (after key ``n``), the first due
    ``LEAD`` seconds from now: the keys and their due times."""
    keys = [C.key(n + i) for i in range(int(SLICE_RATE * SLICE_SECONDS))]
    first = time.time() + LEAD
    return keys, [first + i / SLICE_RATE for i in range(len(keys))]


async def wait_for_starts(count: int, timeout: float) -> None:
    """Until the probe has recorded ``count`` refresh starts, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while REC.count < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def slice_lag(w: Coalescer, n: int) -> dict[str, Any]:
    """On the worker ``w`` (just started), schedule ``slice_due(n)`` and wait for their
    starts: the percentiles of their start lags (``REC``, reset by the caller)."""
    await asyncio.sleep(0.3)  # leadership taken
    slice_keys, slice_times = slice_due(n)
    await schedule(w, slice_keys, slice_times)
    await w.flush()
    await wait_for_starts(len(slice_keys), LEAD + SLICE_SECONDS + 10.0)
    return {**C.percentiles(REC.lags_ms), "slice": len(slice_keys), "started": REC.count}


async def slice_lag_baseline(b: Baseline, n: int) -> dict[str, Any]:
    """``slice_lag`` for the baseline: its worker started, the slice added to its ZSET."""
    REC.reset(offset_ms=0.0)
    b.start_worker()
    slice_keys, slice_times = slice_due(n)
    await b.redis.zadd(b.zset, dict(zip(slice_keys, slice_times, strict=True)))
    await wait_for_starts(len(slice_keys), LEAD + SLICE_SECONDS + 10.0)
    return {**C.percentiles(REC.lags_ms), "slice": len(slice_keys), "started": REC.count}


async def load(c: Coalescer, sync: Any, keys: list[str], times: list[float]) -> dict[str, float]:
    """Schedule ``keys`` at ``times`` through ``c`` (after one key: scripts loaded, shard
    keys created): Redis bytes per key (``used_memory`` before and after), keys/s."""
    c.touch(C.key(-1), delay="1h")
    await c.flush()
    mem0 = used_memory(sync)
    t0 = time.perf_counter()
    await schedule(c, keys, times)
    await c.flush()
    load_s = time.perf_counter() - t0
    return {"bytes_per_key": (used_memory(sync) - mem0) / len(keys),
            "load_keys_per_second": len(keys) / load_s}


async def load_baseline(b: Baseline, sync: Any, keys: list[str],
                        times: list[float]) -> dict[str, float]:
    """``load`` for the baseline: the due times added to its ZSET, 10,000 a ``ZADD``."""
    await b.redis.zadd(b.zset, {C.key(-1): time.time() + 3600})
    mem0 = used_memory(sync)
    t0 = time.perf_counter()
    for i in range(0, len(keys), 10_000):
        await b.redis.zadd(b.zset, dict(zip(keys[i:i + 10_000], times[i:i + 10_000],
                                            strict=True)))
    load_s = time.perf_counter() - t0
    return {"bytes_per_key": (used_memory(sync) - mem0) / len(keys),
            "load_keys_per_second": len(keys) / load_s}


async def scheduled_coalescer(server: Server, sizes: C.Sizes, n: int) -> dict[str, Any]:
    sync = server.client(timeout=60)
    kw = {"window": "100ms", "max_wait": "200ms", "concurrency": F.LAG_CONCURRENCY}
    async with C.coalescer(server, False, **kw) as c:
        loaded = await load(c, sync, [C.key(i) for i in range(n)], far_times(n))
    sync.close()
    REC.reset(offset_ms=await C.clock_offset_ms(server.url))
    async with C.coalescer(server, True, **kw) as w:
        lag = await slice_lag(w, n)
    return {**lag, "keys": n, **loaded}


async def scheduled_baseline(server: Server, sizes: C.Sizes, n: int) -> dict[str, Any]:
    sync = server.client(timeout=60)
    async with Baseline(server.url, probe.refresh, delay=0.0) as b:
        loaded = await load_baseline(b, sync, [C.key(i) for i in range(n)], far_times(n))
        lag = await slice_lag_baseline(b, n)
    sync.close()
    return {**lag, "keys": n, **loaded}
