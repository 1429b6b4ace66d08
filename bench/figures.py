"""The measurements of the benchmark's in-process workloads, each for coalescer and for the
baseline design: lost updates (burst, churn), hot-key and distinct touches, commands per
touch, start lag, drain, idle cost and a million pending keys.

Every function takes a fresh server (``bench.valkey.Server``) and the sizes of this run,
and returns a plain dict for results.json. What they share is in ``bench.common``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from redis.asyncio import Redis

from coalescer import Coalescer
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from . import probe
from .baseline import Baseline
from .common import (
    HOT_KEY,
    RULE,
    SHARD,
    CpuMeter,
    Sizes,
    baseline_scheduled,
    baseline_settled,
    clock_offset_ms,
    coalescer,
    coalescer_scheduled,
    coalescer_settled,
    idle_commands,
    key,
    lost_updates,
    paced,
    percentiles,
    settle,
    touch_distinct,
)
from .probe import REC
from .valkey import (
    MonitorCounter,
    Server,
    calls_delta,
    commandstats,
    used_memory,
)

W = TypeVar("W")  # what a writer context opens: a Coalescer or a Baseline


# -- lost updates --------------------------------------------------------------------------


BURST_TOUCHES = 50
BURST_SECONDS = 2.5
BURST_WINDOW = 1.0  # coalescer window and baseline delay
BURST_MAX_WAIT = "2s"
BURST_WORK = 0.05  # each refresh works up to 50 ms, so touches land while one runs


async def burst_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    REC.reset(offset_ms=await clock_offset_ms(server.url), work=BURST_WORK)
    touches: dict[str, list[float]] = defaultdict(list)
    async with coalescer(server, True, window=f"{BURST_WINDOW}s",
                         max_wait=BURST_MAX_WAIT) as c:
        async def one(_i: int) -> None:
            c.touch(HOT_KEY)
            touches[HOT_KEY].append(time.time())
        await paced(BURST_TOUCHES, BURST_SECONDS, one)
        await c.flush()
        await settle(coalescer_settled(c), timeout=BURST_WINDOW + 8)
        out = lost_updates(touches, REC.starts, await coalescer_scheduled(c.redis))
    out["settings"] = f"window {BURST_WINDOW}s, max_wait {BURST_MAX_WAIT}, work <= 50 ms"
    return out


async def burst_baseline(server: Server, sizes: Sizes, sliding: bool = False) -> dict[str, Any]:
    REC.reset(offset_ms=0.0, work=BURST_WORK)
    touches: dict[str, list[float]] = defaultdict(list)
    async with Baseline(server.url, probe.refresh, delay=BURST_WINDOW, sliding=sliding) as b:
        b.start_worker()

        async def one(_i: int) -> None:
            await b.touch(HOT_KEY)
            touches[HOT_KEY].append(time.time())
        await paced(BURST_TOUCHES, BURST_SECONDS, one)
        await settle(baseline_settled(b), timeout=BURST_WINDOW + 8)
        out = lost_updates(touches, REC.starts, await baseline_scheduled(b))
        out["dropped_by_dedup"] = b.dropped
    out["settings"] = (f"delay {BURST_WINDOW}s, work <= 50 ms, "
                       f"{'sliding' if sliding else 'fixed'} 120 ms dedup")
    return out


CHURN_KEYS = 200
CHURN_RATE = 1000  # touches/s over CHURN_KEYS keys, at random
CHURN_WINDOW = 0.3
CHURN_WORK = 0.03


async def churn_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    REC.reset(offset_ms=await clock_offset_ms(server.url), work=CHURN_WORK)
    rng = random.Random(7)
    touches: dict[str, list[float]] = defaultdict(list)
    n = int(CHURN_RATE * sizes.churn_seconds)
    async with coalescer(server, True, window=f"{CHURN_WINDOW}s", max_wait="1s") as c:
        async def one(_i: int) -> None:
            k = key(rng.randrange(CHURN_KEYS))
            c.touch(k)
            touches[k].append(time.time())
        await paced(n, sizes.churn_seconds, one)
        await c.flush()
        await settle(coalescer_settled(c), timeout=10)
        out = lost_updates(touches, REC.starts, await coalescer_scheduled(c.redis))
    out["settings"] = (f"{n} touches of {CHURN_KEYS} keys at random over "
                       f"{sizes.churn_seconds:g}s, window {CHURN_WINDOW}s, max_wait 1s, "
                       f"work <= {CHURN_WORK * 1000:g} ms")
    return out


async def churn_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    REC.reset(offset_ms=0.0, work=CHURN_WORK)
    rng = random.Random(7)
    touches: dict[str, list[float]] = defaultdict(list)
    n = int(CHURN_RATE * sizes.churn_seconds)
    async with Baseline(server.url, probe.refresh, delay=CHURN_WINDOW) as b:
        b.start_worker()

        async def one(_i: int) -> None:
            k = key(rng.randrange(CHURN_KEYS))
            await b.touch(k)
            touches[k].append(time.time())
        await paced(n, sizes.churn_seconds, one)
        await settle(baseline_settled(b), timeout=10)
        out = lost_updates(touches, REC.starts, await baseline_scheduled(b))
        out["dropped_by_dedup"] = b.dropped
    out["settings"] = f"as coalescer; delay {CHURN_WINDOW}s"
    return out


# -- hot key and distinct keys -------------------------------------------------------------


async def hot_key_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    chunk = 10_000
    rounds = sizes.hot_touches // chunk
    async with coalescer(server, False) as c:
        touch = c.touch
        c.touch(HOT_KEY)
        await c.flush()
        cpu = CpuMeter(server)
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(chunk):
                touch(HOT_KEY)
            await asyncio.sleep(0)  # the flusher runs between chunks
        dt = time.perf_counter() - t0
        await c.flush()
        used = cpu.done(time.perf_counter() - t0, rounds * chunk)
    return {"calls": rounds * chunk, "seconds": dt, "per_second": rounds * chunk / dt,
            "cpu": used}


async def hot_key_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    chunk = 10_000
    rounds = max(1, sizes.hot_touches_baseline // chunk)
    async with Baseline(server.url) as b:
        touch = b.touch
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(chunk):
                await touch(HOT_KEY)
            await asyncio.sleep(0)
        dt = time.perf_counter() - t0
        sent = b.sent
    return {"calls": rounds * chunk, "seconds": dt, "per_second": rounds * chunk / dt,
            "zadds": sent}


async def distinct_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    keys = [key(i) for i in range(sizes.distinct)]
    async with coalescer(server, False, window="1h", max_wait="2h") as c:
        out = await _distinct_into(c, keys, CpuMeter(server))
        out["redis_holds"] = await c.redis.zcard(SHARD.due(RULE))
    return out


async def _distinct_into(c: Coalescer, keys: list[str], cpu: CpuMeter) -> dict[str, Any]:
    """Touch never-seen ``keys`` once each from one loop, then flush: the rate, and CPU."""
    t0 = time.perf_counter()
    refused = await touch_distinct(c, keys)
    t_touched = time.perf_counter() - t0
    await c.flush()
    dt = time.perf_counter() - t0
    return {"keys": len(keys), "seconds": dt, "per_second": len(keys) / dt,
            "touch_loop_seconds": t_touched, "backpressure_refusals": refused,
            "cpu": cpu.done(dt, len(keys))}


async def _baseline_writers(b: Baseline, keys: list[str], writers: int) -> None:
    it = iter(keys)

    async def writer() -> None:
        for k in it:
            await b.touch(k)
    await asyncio.gather(*(writer() for _ in range(writers)))


async def distinct_baseline(server: Server, sizes: Sizes, writers: int = 1) -> dict[str, Any]:
    """One writer: the same driver as coalescer's (one loop); more: concurrent tasks."""
    keys = [key(i) for i in range(sizes.distinct_baseline)]
    async with Baseline(server.url, delay=3600) as b:
        cpu = CpuMeter(server)
        t0 = time.perf_counter()
        await _baseline_writers(b, keys, writers)
        dt = time.perf_counter() - t0
        used = cpu.done(dt, len(keys))
        held = await b.redis.zcard(b.zset)
    return {"keys": len(keys), "seconds": dt, "per_second": len(keys) / dt,
            "redis_holds": held, "writers": writers, "cpu": used}


async def commands_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    keys = [key(i) for i in range(sizes.cmds_distinct)]

    async def write(c: Coalescer) -> None:
        await touch_distinct(c, keys)
        await c.flush()
    return await _commands_per_touch(
        server, len(keys), lambda: coalescer(server, False, window="1h", max_wait="2h"), write)


async def commands_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    keys = [key(i) for i in range(sizes.cmds_distinct_baseline)]

    async def write(b: Baseline) -> None:
        await _baseline_writers(b, keys, 1)
    return await _commands_per_touch(
        server, len(keys), lambda: Baseline(server.url, delay=3600), write)


async def _commands_per_touch(server: Server, n: int,
                              writer: Callable[[], AbstractAsyncContextManager[W]],
                              write: Callable[[W], Awaitable[None]]) -> dict[str, Any]:
    """Redis commands (MONITOR, and INFO commandstats) while ``write`` touches ``n``
    distinct keys through the writer ``writer()`` opens."""
    mon = MonitorCounter(server.port)
    sync = server.client()
    try:
        async with writer() as w:
            before = commandstats(sync)
            t0 = time.time()
            await write(w)
            t1 = time.time()
            after = commandstats(sync)
        counted = mon.count(t0, t1)
    finally:
        mon.close()
        sync.close()
    return _per_touch(counted, calls_delta(before, after), n)


def _per_touch(counted: dict[str, Any], stats: dict[str, int], n: int) -> dict[str, Any]:
    return {"distinct_touches": n, "commands": counted["top"],
            "per_touch": counted["top"] / n, "by_command": counted["by_command"],
            "script_internal_calls_per_touch": counted["nested"] / n,
            "commandstats_calls_per_touch": sum(stats.values()) / n}


# -- start lag -----------------------------------------------------------------------------

# A process that does nothing but sleep 1 ms at a time, run beside a lag measurement: how
# late its wake-ups come is how much the machine itself (other processes, the hypervisor)
# delayed every process then, coalescer's included. Ends when its stdin closes.
_STALL_PROBE = """
import json, sys, threading, time
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
late = []
while not stop.is_set():
    t = time.perf_counter()
    time.sleep(0.001)
    ms = (time.perf_counter() - t) * 1000 - 1
    if ms > 5:
        late.append(ms)
print(json.dumps({"stalls_over_5ms": len(late), "max_stall_ms": max(late, default=0.0)}))
"""


@contextlib.contextmanager
def stall_probe(into: dict[str, Any]) -> Iterator[None]:
    """Run the idle probe process meanwhile; its figures go into ``into["machine"]``."""
    proc = subprocess.Popen([sys.executable, "-c", _STALL_PROBE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        out, _ = proc.communicate(input="", timeout=30)
        into["machine"] = json.loads(out) if out.strip() else {}



LAG_WINDOW = 0.5


LAG_CONCURRENCY = 256  # the tuned setting; DEFAULT_CONCURRENCY is the rules' default
DEFAULT_CONCURRENCY = 16


async def lag_coalescer(server: Server, sizes: Sizes, rate: int,
                        concurrency: int = LAG_CONCURRENCY) -> dict[str, Any]:
    REC.reset(offset_ms=await clock_offset_ms(server.url))
    n = int(rate * sizes.lag_seconds)
    touches: dict[str, list[float]] = {}
    machine: dict[str, Any] = {}
    async with coalescer(server, True, window=f"{LAG_WINDOW}s", concurrency=concurrency) as c:
        await asyncio.sleep(0.3)  # leadership taken

        async def one(i: int) -> None:
            k = key(i)
            c.touch(k)
            touches[k] = [time.time()]
        with stall_probe(machine):  # the touches, and the refreshes due 0.5 s after them
            await paced(n, sizes.lag_seconds, one)
            await asyncio.sleep(LAG_WINDOW)
        await c.flush()
        await settle(coalescer_settled(c), timeout=sizes.lag_settle)
        scheduled = await coalescer_scheduled(c.redis)
        censored = await _censored_coalescer(c, scheduled)
        g1 = lost_updates(touches, REC.starts, scheduled)
        metrics = c.metrics
    out = percentiles(REC.lags_ms, censored)
    out.update(rate=rate, keys=n, g1=g1, window=LAG_WINDOW, concurrency=concurrency, **machine)
    out["metrics_histogram"] = metrics.start_lag_buckets()
    return out


async def _censored_coalescer(c: Coalescer, scheduled: set[str]) -> list[float]:
    if not scheduled:
        return []
    offset = REC.offset_ms
    now = time.time() * 1000
    scores = await c.redis.zrange(SHARD.due(RULE), 0, -1, withscores=True)
    return [now - (float(s) - offset) for _, s in scores if now > float(s) - offset]


async def lag_baseline(server: Server, sizes: Sizes, rate: int) -> dict[str, Any]:
    REC.reset(offset_ms=0.0)
    n = int(rate * sizes.lag_seconds)
    touches: dict[str, list[float]] = {}
    async with Baseline(server.url, probe.refresh, delay=LAG_WINDOW) as b:
        b.start_worker()

        async def one(i: int) -> None:
            k = key(i)
            await b.touch(k)
            touches[k] = [time.time()]
        await paced(n, sizes.lag_seconds, one)
        await settle(baseline_settled(b), timeout=sizes.lag_settle)
        scheduled = await baseline_scheduled(b)
        now = time.time() * 1000
        scores: list[Any] = await b.redis.zrange(b.zset, 0, -1, withscores=True)
        censored = [now - float(s) * 1000 for _, s in scores if now > float(s) * 1000]
        g1 = lost_updates(touches, REC.starts, scheduled)
    out = percentiles(REC.lags_ms, censored)
    out.update(rate=rate, keys=n, g1=g1, window=LAG_WINDOW)
    return out


# -- drain ---------------------------------------------------------------------------------


async def drain_coalescer(server: Server, sizes: Sizes,
                          concurrency: int | None = None) -> dict[str, Any]:
    """``concurrency`` None: the tuned ``sizes.drain_concurrency``."""
    n = sizes.drain_keys
    keys = [key(i) for i in range(n)]
    concurrency = concurrency or sizes.drain_concurrency
    kw = {"window": "100ms", "max_wait": "1s", "concurrency": concurrency}
    async with coalescer(server, False, **kw) as w:
        await touch_distinct(w, keys)
        await w.flush()
        t_loaded = time.time()
    await asyncio.sleep(0.3)  # every key is due
    REC.reset(offset_ms=await clock_offset_ms(server.url))
    sync = server.client()
    before = commandstats(sync)
    t_start = time.time()
    async with coalescer(server, True, **kw) as c:
        deadline = time.monotonic() + 120
        while REC.count == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        cpu, counted, t_cpu = CpuMeter(server), REC.count, time.time()  # the start-up left out
        while REC.count < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        t_started = time.time()
        await settle(coalescer_settled(c), timeout=30, stable=0.0)
        t_acked = time.time()
        used = cpu.done(t_acked - t_cpu, n - counted)
        scheduled = await coalescer_scheduled(c.redis)
        after = commandstats(sync)
    sync.close()
    first = REC.first or t_start
    delta = calls_delta(before, after)
    touches = {k: [t_loaded] for k in keys}
    return {"keys": n, "concurrency": concurrency,
            "per_second": n / (t_acked - first),
            "per_second_started": REC.count / max(1e-9, (REC.last or t_started) - first),
            "startup_to_first_refresh_s": first - t_start,
            "drain_seconds": t_acked - first,
            "evalsha_per_refresh": (delta.get("evalsha", 0) + delta.get("eval", 0)) / n,
            "cpu": used, "g1": lost_updates(touches, REC.starts, scheduled)}


async def drain_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    n = sizes.drain_baseline_keys
    keys = [key(i) for i in range(n)]
    REC.reset(offset_ms=0.0)
    async with Baseline(server.url, probe.refresh) as b:
        t = time.time()
        pipe = b.redis.pipeline(transaction=False)
        pipe.zadd(b.zset, {k: t - 1 for k in keys})
        await pipe.execute()
        touches = {k: [t] for k in keys}
        b.start_worker()
        deadline = time.monotonic() + 10
        while REC.count == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        first = REC.first or time.time()
        await asyncio.sleep(sizes.drain_baseline_seconds)
        count, t_end = REC.count, time.time()
        scheduled = await baseline_scheduled(b)
    return {"keys": n, "per_second": count / (t_end - first), "refreshed": count,
            "seconds": t_end - first, "g1": lost_updates(touches, REC.starts, scheduled)}


# -- idle node -----------------------------------------------------------------------------


async def idle_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    return await idle_commands(server, lambda: coalescer(server, True), 1.5, sizes.idle_seconds)


@contextlib.asynccontextmanager
async def _baseline_worker(server: Server) -> AsyncIterator[Baseline]:
    async with Baseline(server.url) as b:
        b.start_worker()
        yield b


async def idle_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    return await idle_commands(server, lambda: _baseline_worker(server), 1.0, sizes.idle_seconds)


# -- 1,000,000 pending keys ----------------------------------------------------------------


def _evalsha_usec(sync: Any) -> float:
    stats = sync.info("commandstats")
    return sum(float(v["usec"]) for name, v in stats.items()
               if name in ("cmdstat_evalsha", "cmdstat_eval"))


async def pending_coalescer(server: Server, sizes: Sizes, n: int) -> dict[str, Any]:
    """Memory per pending key, and touch and claim cost, with ``n`` keys pending (and due)."""
    keys = [key(i) for i in range(n)]
    sync = server.client(timeout=60)
    async with coalescer(server, False, window="100ms", max_wait="200ms") as c:
        c.touch(key(-1))  # scripts loaded, shard keys created
        await c.flush()
        mem0 = used_memory(sync)
        t0 = time.perf_counter()
        await touch_distinct(c, keys)
        await c.flush()
        load_s = time.perf_counter() - t0
        mem1 = used_memory(sync)
        await asyncio.sleep(0.3)  # every key is due
        costs = await _coalescer_costs(server, sync, keys, sizes.cost_reps)
    sync.close()
    return {"pending": n, "bytes_per_key": (mem1 - mem0) / n, "load_keys_per_second": n / load_s,
            **costs}


async def _coalescer_costs(server: Server, sync: Any, keys: list[str],
                           reps: int) -> dict[str, Any]:
    """Redis time per key of coalescer's scripts, client wall time too (median of ``reps``).

    touch: 2000 never-seen keys (removed again, untimed, so the pending count
    stays put); retouch: 2000 pending keys at random; claim: 500 due keys
    (acked and touched again, untimed).
    """
    r = Redis.from_url(server.url, decode_responses=True)
    scripts = Scripts(r)
    rng = random.Random(3)
    samples: dict[str, list[float]] = defaultdict(list)
    batch, claim_n = min(2000, len(keys)), min(500, len(keys) // 2)

    async def timed(name: str, n: int, call: Awaitable[Any]) -> Any:
        u0 = _evalsha_usec(sync)
        t0 = time.perf_counter()
        result = await call
        samples[f"{name}_us_per_key_wall"].append((time.perf_counter() - t0) / max(1, n) * 1e6)
        samples[f"{name}_us_per_key_server"].append((_evalsha_usec(sync) - u0) / max(1, n))
        return result

    try:
        state = await scripts.acquire(SHARD, node_id="bench-cost", lease_ms=120_000, mine="")
        leader = state.holder
        for rep in range(reps):
            fresh = [f"stats:user:fresh{rep}x{j}" for j in range(2000)]
            await timed("touch", len(fresh),
                        scripts.upsert(SHARD, [UpsertGroup(RULE, 100, 200, fresh)]))
            pipe = r.pipeline(transaction=False)
            pipe.zrem(SHARD.due(RULE), *fresh)
            pipe.hdel(SHARD.meta, *fresh)
            await pipe.execute()
            sample = rng.sample(keys, batch)
            await timed("retouch", batch,
                        scripts.upsert(SHARD, [UpsertGroup(RULE, 100, 200, sample)]))
            await asyncio.sleep(0.25)  # the re-touched keys are due again
            got = await timed("claim", claim_n, scripts.claim(
                SHARD, leader=leader, node_id="bench-cost",
                claim_lease_ms=120_000, sleep_cap_ms=1000, limits=[(RULE, claim_n)]))
            # put the claimed keys back: acked, then touched again (untimed)
            await scripts.ack(SHARD, [(RULE, [(x.key, x.token) for x in got.claims])])
            back = [x.key for x in got.claims]
            if back:
                await scripts.upsert(SHARD, [UpsertGroup(RULE, 100, 200, back)])
            await asyncio.sleep(0.25)
    finally:
        await r.aclose()
    out: dict[str, Any] = {name: statistics.median(v) for name, v in samples.items()}
    out.update(touch_batch=2000, retouch_batch=batch, claim_batch=claim_n)
    return out


async def pending_baseline(server: Server, sizes: Sizes, n: int) -> dict[str, Any]:
    keys = [key(i) for i in range(n)]
    sync = server.client(timeout=60)
    async with Baseline(server.url, delay=0.0) as b:
        await b.redis.zadd(b.zset, {key(-1): 0})
        mem0 = used_memory(sync)
        past = time.time() - 10
        for i in range(0, n, 10_000):
            await b.redis.zadd(b.zset, {k: past + j * 1e-6 for j, k in
                                        enumerate(keys[i:i + 10_000], start=i)})
        mem1 = used_memory(sync)
        costs = await _baseline_costs(b, sync, keys, sizes.cost_reps)
    sync.close()
    return {"pending": n, "bytes_per_key": (mem1 - mem0) / n, **costs}


def _usec(sync: Any, names: tuple[str, ...]) -> float:
    stats = sync.info("commandstats")
    return sum(float(v["usec"]) for name, v in stats.items()
               if name.removeprefix("cmdstat_") in names)


async def _baseline_costs(b: Baseline, sync: Any, keys: list[str], reps: int) -> dict[str, Any]:
    """The baseline's Redis time (and wall time) per key: ZADD of new and of pending keys
    (one command per touch, as its write path sends them), and one poll of 20 due keys."""
    rng = random.Random(3)
    samples: dict[str, list[float]] = defaultdict(list)
    poll_cmds = ("set", "zrangebyscore", "zscore", "zrem", "get", "del")
    past = time.time() - 10

    def record(name: str, n: int, t0: float, u0: float, cmds: tuple[str, ...]) -> None:
        samples[f"{name}_us_per_key_wall"].append((time.perf_counter() - t0) / max(1, n) * 1e6)
        samples[f"{name}_us_per_key_server"].append((_usec(sync, cmds) - u0) / max(1, n))

    for rep in range(reps):
        fresh = [f"stats:user:fresh{rep}x{j}" for j in range(200)]
        for name, batch in (("touch", fresh), ("retouch", rng.sample(keys, min(200, len(keys))))):
            u0, t0 = _usec(sync, ("zadd",)), time.perf_counter()
            for k in batch:
                await b.redis.zadd(b.zset, {k: past})
            record(name, len(batch), t0, u0, ("zadd",))
        await b.redis.zrem(b.zset, *fresh)
        u0, t0 = _usec(sync, poll_cmds), time.perf_counter()
        got = await b.poll_once()
        record("claim", got, t0, u0, poll_cmds)
    out: dict[str, Any] = {name: statistics.median(v) for name, v in samples.items()}
    out["claim_batch"] = b.batch
    return out
