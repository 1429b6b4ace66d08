"""The measurements of the benchmark, each for coalescer and for the baseline design.

Every function takes a fresh server (``bench.valkey.Server``) and the sizes of
this run, and returns a plain dict for results.json. Clocks: touch and refresh
start times are this host's ``time.time()``; coalescer's due times (server
clock) are converted with the offset measured by ``TIME``. Every loop is
bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from coalescer import BackpressureError, Coalescer, Config
from coalescer.store.connection import connect
from coalescer.store.keys import KeySpace
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts

from . import probe
from .baseline import Baseline
from .probe import REC
from .valkey import (
    Cluster,
    MonitorCounter,
    Server,
    calls_delta,
    commandstats,
    free_port,
    server_cpu,
    start_cluster,
    used_memory,
)

NS = "bench"
RULE = "r"
SHARD = KeySpace(NS, 1).shard(0)
HOT_KEY = "stats:user:1"
WORK_DIR = Path(__file__).resolve().parent.parent


def key(i: int) -> str:
    return f"stats:user:{i}"


def rules_text(*, window: str = "500ms", max_wait: str = "5s", concurrency: int = 256,
               absorb: str = "50ms", lease: str = "3s", claim_lease: str = "5s",
               handler: str = "bench.probe:refresh", shards: int = 1) -> str:
    return f"""\
namespace: {NS}
shards: {shards}
leader_lease: {lease}
claim_lease: {claim_lease}
defaults:
  absorb: {absorb}
  concurrency: {concurrency}
  timeout: 30s
rules:
  - name: {RULE}
    match: "stats:user:{{user_id}}"
    window: {window}
    max_wait: {max_wait}
    handler: {handler}
"""


def config(**kw: Any) -> Config:
    return Config.from_string(rules_text(**kw), source="<bench>")


def coalescer(server: Server, worker: bool, **kw: Any) -> Coalescer:
    return Coalescer(config(**kw), redis_url=server.url, worker=worker, node_id="bench-node")


@dataclass
class Sizes:
    """How big each figure is; ``quick()`` shrinks them."""

    hot_touches: int = 3_000_000
    hot_touches_baseline: int = 1_000_000
    distinct: int = 300_000
    distinct_baseline: int = 20_000
    cmds_distinct: int = 50_000
    cmds_distinct_baseline: int = 5_000
    lag_seconds: float = 5.0
    lag_settle: float = 10.0
    churn_seconds: float = 4.0
    drain_keys: int = 50_000
    drain_concurrency: int = 2000
    drain_baseline_keys: int = 2_000
    drain_baseline_seconds: float = 5.0
    idle_seconds: float = 5.0
    million: int = 1_000_000
    small: int = 1_000
    cost_reps: int = 9
    peer_hot_touches: int = 10_000  # the peers' hot-key calls each make round trips
    throttle_keys: int = 2_000  # 10 s at the throttled rule's 200/s
    bulk_keys: int = 100_000  # one bulk import from 16 threads
    items_keys: int = 10_000  # customers touched with items (bench/items.py)
    items_per_key: int = 20  # distinct items each: 200,000 items

    @classmethod
    def quick(cls) -> Sizes:
        return cls(hot_touches=1_000_000, hot_touches_baseline=300_000, distinct=100_000,
                   distinct_baseline=5_000, cmds_distinct=20_000, cmds_distinct_baseline=2_000,
                   lag_seconds=2.0, lag_settle=4.0, churn_seconds=2.0, drain_keys=20_000,
                   drain_baseline_seconds=2.0, idle_seconds=3.0, million=200_000, cost_reps=5,
                   peer_hot_touches=3_000, throttle_keys=1_000, items_per_key=10)


# -- helpers -------------------------------------------------------------------------------


async def clock_offset_ms(url: str) -> float:
    """Server clock minus this host's clock, ms (the sample with the shortest round trip)."""
    r = Redis.from_url(url)
    best: tuple[float, float] | None = None
    try:
        for _ in range(7):
            t0 = time.time()
            sec, usec = await r.time()
            t1 = time.time()
            off = (sec * 1000.0 + usec / 1000.0) - (t0 + t1) * 500.0
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, off)
    finally:
        await r.aclose()
    assert best is not None
    return best[1]


async def paced(n: int, seconds: float, fn: Callable[[int], Awaitable[None]]) -> float:
    """Call ``fn(i)`` for i < n, the i-th at ``i * seconds / n``; returns the elapsed time."""
    t0 = time.monotonic()
    i = 0
    while i < n:
        ahead = t0 + i * seconds / n - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
        while i < n and t0 + i * seconds / n <= time.monotonic():
            await fn(i)
            i += 1
    return time.monotonic() - t0


async def settle(check: Callable[[], Awaitable[bool]], timeout: float,
                 stable: float = 0.3) -> bool:
    """Wait until ``check()`` holds for ``stable`` seconds in a row, at most ``timeout``."""
    deadline = time.monotonic() + timeout
    since: float | None = None
    while time.monotonic() < deadline:
        if await check():
            now = time.monotonic()
            since = since if since is not None else now
            if now - since >= stable:
                return True
        else:
            since = None
        await asyncio.sleep(0.02)
    return False


def coalescer_settled(c: Coalescer) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        r = c.redis
        due, inflight = await asyncio.gather(r.zcard(SHARD.due(RULE)),
                                             r.zcard(SHARD.inflight(RULE)))
        return due + inflight == 0 and REC.running == 0
    return check


def baseline_settled(b: Baseline) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await b.redis.zcard(b.zset) == 0 and b.running == 0
    return check


async def coalescer_scheduled(r: Any) -> set[str]:
    due = await r.zrange(SHARD.due(RULE), 0, -1)
    inflight = await r.zrange(SHARD.inflight(RULE), 0, -1)
    return {str(k) for k in [*due, *inflight]}


async def baseline_scheduled(b: Baseline) -> set[str]:
    return {str(k) for k in await b.redis.zrange(b.zset, 0, -1)}


def lost_updates(touches: dict[str, list[float]], starts: dict[str, float],
                 scheduled: Iterable[str] = (),
                 refreshes: dict[str, int] | None = None) -> dict[str, Any]:
    """A touch is lost if no refresh of its key starts after it (and none is scheduled).

    A touch with no refresh after it whose key is still scheduled (pending or in
    flight when the workload ended) is *late*, not lost. ``starts`` holds each
    key's latest refresh start; ``refreshes`` the refreshes per key (REC's by default).
    """
    per_key = REC.per_key if refreshes is None else refreshes
    sched = set(scheduled)
    lost = late = total = 0
    lost_keys: set[str] = set()
    for k, times in touches.items():
        last = starts.get(k, -math.inf)
        for t in times:
            total += 1
            if last > t:
                continue
            if k in sched:
                late += 1
            else:
                lost += 1
                lost_keys.add(k)
    return {"touches": total, "lost": lost, "late": late, "lost_keys": len(lost_keys),
            "refreshes": sum(n for k, n in per_key.items() if k in touches)}


def percentiles(values: list[float], censored: list[float] | None = None) -> dict[str, Any]:
    """p50/p99/max of ``values`` plus ``censored`` lower bounds (refreshes not yet started).

    A percentile is flagged as a lower bound (``*_lower_bound``) when a censored
    value is at or below it: the true percentile may then be higher.
    """
    cens = censored or []
    allv = sorted([*values, *cens])
    out: dict[str, Any] = {"n": len(values), "not_started": len(cens)}
    if not allv:
        return out
    for name, q in (("p50", 0.50), ("p99", 0.99)):
        idx = min(len(allv) - 1, max(0, math.ceil(q * len(allv)) - 1))
        v = allv[idx]
        out[name] = v
        out[f"{name}_lower_bound"] = any(c <= v for c in cens)
    out["max"] = allv[-1]
    out["mean"] = statistics.fmean(allv)
    return out


class CpuMeter:
    """CPU used over a span by Python and by Redis, for the CPU-per-item section.

    Python: this process (getrusage), or with ``pid`` that process and its children
    (from /proc: a ``run --processes N`` group). Redis: INFO cpu (used_cpu_user +
    used_cpu_sys of the server process) and INFO commandstats ``usec`` (time inside
    commands, scripts included; INFO and CONFIG left out), summed over ``servers``
    (a cluster's masters).
    """

    def __init__(self, *servers: Server, pid: int | None = None) -> None:
        self._clients = [s.client() for s in servers]
        self._pid = pid
        self._p0 = self._python()
        self._s0 = self._server()
        self._u0 = self._usec()
        self._m0 = machine_cpu()

    def _python(self) -> float:
        if self._pid is not None:
            return process_tree_cpu(self._pid)
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def _server(self) -> float:
        return sum(server_cpu(c) for c in self._clients)

    def _usec(self) -> dict[str, int]:
        total: dict[str, int] = defaultdict(int)
        for c in self._clients:
            for name, usec in commandstats(c, "usec").items():
                total[name] += usec
        return total

    def done(self, wall: float, items: int) -> dict[str, Any]:
        """The span's CPU seconds, and per item (a touch, a refresh) in microseconds."""
        python, redis_cpu = self._python() - self._p0, self._server() - self._s0
        usec = calls_delta(self._u0, self._usec())
        busy, steal = (b - a for a, b in zip(self._m0, machine_cpu(), strict=True))
        for c in self._clients:
            c.close()
        per = 1e6 / max(1, items)
        # A call made inside a script counts in commandstats twice: under its own name and
        # inside EVALSHA's time. So where scripts ran, their time is the command time.
        scripts = sum(usec.get(name, 0) for name in SCRIPT_COMMANDS)
        command_us = scripts or sum(usec.values())
        return {"python_cpu_s": python, "redis_cpu_s": redis_cpu, "wall_s": wall,
                "redis_usec_by_command": usec, "servers": len(self._clients), "items": items,
                "machine_cpu_s": busy, "machine_steal_s": steal,
                "other_cpu_s": max(0.0, busy - python - redis_cpu),
                "redis_command_s": command_us / 1e6,
                "redis_command_source": "scripts" if scripts else "all commands",
                "python_us_per_item": python * per, "redis_cpu_us_per_item": redis_cpu * per,
                "redis_command_us_per_item": command_us / max(1, items)}


SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (every core, every process), and stolen
    by the hypervisor (Linux /proc/stat; zeros elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == p]
    return total


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


async def _touch_distinct(c: Coalescer, keys: list[str]) -> int:
    """Touch each key once, yielding every 1000 so the flusher writes meanwhile."""
    refused = 0
    touch = c.touch
    for i, k in enumerate(keys):
        for _ in range(10_000):  # bounded: back-pressure only while Redis catches up
            try:
                touch(k)
                break
            except BackpressureError:
                refused += 1
                await asyncio.sleep(0.001)
        if i % 1000 == 999:
            await asyncio.sleep(0)
    return refused


async def distinct_coalescer(server: Server, sizes: Sizes) -> dict[str, Any]:
    keys = [key(i) for i in range(sizes.distinct)]
    async with coalescer(server, False, window="1h", max_wait="2h") as c:
        out = await _distinct_into(c, keys, CpuMeter(server))
        out["redis_holds"] = await c.redis.zcard(SHARD.due(RULE))
    return out


async def _distinct_into(c: Coalescer, keys: list[str], cpu: CpuMeter) -> dict[str, Any]:
    """Touch never-seen ``keys`` once each from one loop, then flush: the rate, and CPU."""
    t0 = time.perf_counter()
    refused = await _touch_distinct(c, keys)
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
    mon = MonitorCounter(server.port)
    sync = server.client()
    try:
        async with coalescer(server, False, window="1h", max_wait="2h") as c:
            before = commandstats(sync)
            t0 = time.time()
            await _touch_distinct(c, keys)
            await c.flush()
            t1 = time.time()
            after = commandstats(sync)
        counted = mon.count(t0, t1)
    finally:
        mon.close()
        sync.close()
    return _per_touch(counted, calls_delta(before, after), len(keys))


async def commands_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    keys = [key(i) for i in range(sizes.cmds_distinct_baseline)]
    mon = MonitorCounter(server.port)
    sync = server.client()
    try:
        async with Baseline(server.url, delay=3600) as b:
            before = commandstats(sync)
            t0 = time.time()
            await _baseline_writers(b, keys, 1)
            t1 = time.time()
            after = commandstats(sync)
        counted = mon.count(t0, t1)
    finally:
        mon.close()
        sync.close()
    return _per_touch(counted, calls_delta(before, after), len(keys))


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
        await _touch_distinct(w, keys)
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
    mon = MonitorCounter(server.port)
    try:
        async with coalescer(server, True):
            await asyncio.sleep(1.5)  # started, leading, settled
            t0 = time.time()
            await asyncio.sleep(sizes.idle_seconds)
            t1 = time.time()
        counted = mon.count(t0, t1)
    finally:
        mon.close()
    return {"seconds": t1 - t0, "commands": counted["top"],
            "per_second": counted["top"] / (t1 - t0), "by_command": counted["by_command"]}


async def idle_baseline(server: Server, sizes: Sizes) -> dict[str, Any]:
    mon = MonitorCounter(server.port)
    try:
        async with Baseline(server.url) as b:
            b.start_worker()
            await asyncio.sleep(1.0)
            t0 = time.time()
            await asyncio.sleep(sizes.idle_seconds)
            t1 = time.time()
        counted = mon.count(t0, t1)
    finally:
        mon.close()
    return {"seconds": t1 - t0, "commands": counted["top"],
            "per_second": counted["top"] / (t1 - t0), "by_command": counted["by_command"]}


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
        await _touch_distinct(c, keys)
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


# -- leader SIGKILL ------------------------------------------------------------------------


FAILOVER_RATE = 50  # distinct keys touched per second while it runs


def _env(log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(WORK_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env["BENCH_REFRESH_LOG"] = str(log)
    env.pop("COALESCER_REDIS_URL", None)
    return env


def _spawn(cmd: list[str], log: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as f:
        return subprocess.Popen(cmd, env=_env(log), cwd=str(log.parent), stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class Feed:
    """Touches fresh keys at a steady rate in the background (bounded in time)."""

    def __init__(self, touch: Callable[[str], Awaitable[None]], rate: int,
                 max_seconds: float = 60.0) -> None:
        self.touches: dict[str, list[float]] = {}
        self._touch = touch
        self._rate = rate
        self._max = max_seconds
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        t0 = time.monotonic()
        i = 0
        while not self._stop.is_set() and time.monotonic() - t0 < self._max:
            k = key(1_000_000 + i)
            await self._touch(k)
            self.touches[k] = [time.time()]
            i += 1
            ahead = t0 + i / self._rate - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def _wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


async def failover_coalescer(server: Server, sizes: Sizes, tmp: Path) -> dict[str, Any]:
    folder = tmp / "failover-coalescer"
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yaml"
    rules.write_text(rules_text(window="200ms", max_wait="1s", handler="bench.probe:logged"))
    exe = str(Path(sys.executable).parent / "coalescer")
    logs = {n: folder / f"refresh-{n}.log" for n in "AB"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    r = Redis.from_url(server.url, decode_responses=True)
    try:
        for n in "AB":
            procs[n] = _spawn([exe, "run", "--rules", str(rules), "--redis", server.url,
                               "--http", "off", "--node-id", n, "--grace", "2"],
                              logs[n], folder / f"node-{n}.out")
            if n == "A":  # A leads; B then joins as the standby
                await _wait_for(lambda: r.get(SHARD.leader), 20, "a leader")
        await _wait_for(lambda: r.zscore(SHARD.nodes, "B"), 20, "the standby's heartbeat")
        async with coalescer(server, False, window="200ms", max_wait="1s") as w:
            async def touch(k: str) -> None:
                w.touch(k)
            feed = Feed(touch, FAILOVER_RATE)
            await _wait_for(lambda: probe.read_log(logs["A"]), 10, "refreshes by the leader")
            await asyncio.sleep(1.0)
            holder = str(await r.get(SHARD.leader)).split("|", 1)[1]
            standby = "B" if holder == "A" else "A"
            t_kill, t_first = await _kill_and_time(procs[holder], logs[standby], "standby")
            await asyncio.sleep(1.0)
            await feed.stop()
            await w.flush()

            async def quiet() -> bool:
                due, inflight = await asyncio.gather(r.zcard(SHARD.due(RULE)),
                                                     r.zcard(SHARD.inflight(RULE)))
                return due + inflight == 0
            await settle(quiet, timeout=15)
            scheduled = await coalescer_scheduled(r)
        starts, per_key = _log_starts(logs.values())
        recovered = await _recovered_count(logs[standby], feed.touches, t_kill, logs[holder])
    finally:
        for p in procs.values():
            _stop(p)
        await r.aclose()
    return {"lease_s": 3.0, "takeover_s": t_first - t_kill, "killed": holder,
            "g1": lost_updates(feed.touches, starts, scheduled, per_key), **recovered}


async def _kill_and_time(victim: subprocess.Popen[bytes], other_log: Path,
                         other: str) -> tuple[float, float]:
    """SIGKILL ``victim``; return the kill time and the other node's first refresh after it."""
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)

    def first_after() -> float | None:
        after = [t for t, _ in probe.read_log(other_log) if t > t_kill]
        return min(after) if after else None
    t_first = await _wait_for(first_after, 15, f"the {other}'s first refresh")
    return t_kill, float(t_first)


async def _recovered_count(standby_log: Path, touches: dict[str, list[float]], t_kill: float,
                           dead_log: Path) -> dict[str, Any]:
    """Keys touched before the kill and refreshed by the standby after it."""
    dead = {k for _, k in probe.read_log(dead_log)}
    late = [k for t, k in probe.read_log(standby_log)
            if t > t_kill and k in touches and touches[k][0] < t_kill - 1.0 and k not in dead]
    return {"recovered_from_dead_node": len(set(late))}


async def failover_baseline(server: Server, sizes: Sizes, tmp: Path) -> dict[str, Any]:
    folder = tmp / "failover-baseline"
    folder.mkdir(parents=True, exist_ok=True)
    logs = {n: folder / f"refresh-{n}.log" for n in "AB"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for n in "AB":
            procs[n] = _spawn([sys.executable, "-m", "bench.baseline", "worker", "--redis",
                               server.url, "--log", str(logs[n]), "--delay", "0.2",
                               "--max-seconds", "120"], logs[n], folder / f"node-{n}.out")
        async with Baseline(server.url, delay=0.2) as b:
            feed = Feed(b.touch, FAILOVER_RATE)

            def both() -> bool:
                return all(probe.read_log(logs[n]) for n in "AB")
            await _wait_for(both, 20, "refreshes by both baseline workers")
            await asyncio.sleep(1.0)
            last = {n: max(t for t, _ in probe.read_log(logs[n])) for n in "AB"}
            victim = max(last, key=lambda n: last[n])  # the one that refreshed last
            survivor = "B" if victim == "A" else "A"
            t_kill, t_first = await _kill_and_time(procs[victim], logs[survivor], "survivor")
            await asyncio.sleep(1.0)
            await feed.stop()
            await settle(lambda: _zero(b), timeout=10)
            scheduled = await baseline_scheduled(b)
        starts, per_key = _log_starts(logs.values())
    finally:
        for p in procs.values():
            _stop(p)
    return {"lock_s": 1.0, "takeover_s": t_first - t_kill,
            "g1": lost_updates(feed.touches, starts, scheduled, per_key)}


def _log_starts(logs: Iterable[Path]) -> tuple[dict[str, float], dict[str, int]]:
    starts: dict[str, float] = {}
    per_key: dict[str, int] = defaultdict(int)
    for log in logs:
        for t, k in probe.read_log(log):
            starts[k] = max(t, starts.get(k, t))
            per_key[k] += 1
    return starts, per_key


async def _zero(b: Baseline) -> bool:
    return await b.redis.zcard(b.zset) == 0


# -- drain with N node processes (run --processes N) ---------------------------------------


PROCESS_SHARDS = 4  # shards spread over the node processes as over nodes
PROCESS_WINDOW = "3s"  # the keys are all loaded before the first is due


async def drain_processes(server: Server, sizes: Sizes, tmp: Path,
                          counts: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """Drain rate of `coalescer run --processes N` for each N, on this one server
    (flushed between), no-op handler, tuned concurrency; ``ratio``: the last N over the first."""
    folder = tmp / "processes"
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yaml"
    rules.write_text(rules_text(window=PROCESS_WINDOW, max_wait="10s",
                                concurrency=sizes.drain_concurrency, shards=PROCESS_SHARDS,
                                handler="bench.probe:noop"))
    out: dict[str, Any] = {"keys": sizes.drain_keys, "shards": PROCESS_SHARDS,
                           "concurrency": sizes.drain_concurrency}
    for n in counts:
        await asyncio.to_thread(_flushall, [server])
        out[f"processes_{n}"] = await _drain_with([server], sizes.drain_keys, rules, n,
                                                  shards=PROCESS_SHARDS)
    first, last = out[f"processes_{counts[0]}"], out[f"processes_{counts[-1]}"]
    out["per_second"] = last["per_second"]
    out["ratio"] = last["per_second"] / first["per_second"]
    return out


def _flushall(masters: list[Server]) -> None:
    for server in masters:
        with server.client() as c:
            c.flushall()


async def _drain_with(masters: list[Server], n_keys: int, rules: Path, n: int, *, shards: int,
                      refresh_log: Path | None = None) -> dict[str, Any]:
    """``coalescer run --processes n`` on ``masters`` (one server, or a cluster's masters),
    once every shard is led: ``n_keys`` keys touched by a write-only coalescer, then the
    time until none is pending or in flight; with ``refresh_log`` (the rules' handler is
    ``bench.probe:buffered``) also the lost updates."""
    folder = rules.parent
    space = KeySpace(NS, shards)
    exe = str(Path(sys.executable).parent / "coalescer")
    proc = _spawn([exe, "run", "--processes", str(n), "--rules", str(rules), "--redis",
                   masters[0].url, "--http", "off", "--node-id", f"p{n}", "--grace", "5"],
                  refresh_log or folder / "unused.log", folder / f"processes-{n}.out")
    conn = await connect(masters[0].url)  # a RedisCluster client on a cluster
    r = conn.client
    try:
        t_spawn = time.time()
        leads = await _wait_led(r, space, n)
        lead_wait = time.time() - t_spawn
        keys = [key(i) for i in range(n_keys)]
        t0 = time.time()
        async with Coalescer.from_yaml(rules, redis_url=masters[0].url, worker=False) as w:
            await _touch_distinct(w, keys)
            await w.flush()
        t_loaded = time.time()
        out = await _time_drain(r, space, len(keys), lambda: CpuMeter(*masters, pid=proc.pid))
        scheduled = await _scheduled(r, space) if refresh_log else set()
    finally:
        await conn.close()
        _stop(proc)
    out.update(processes=n, load_seconds=t_loaded - t0, exit_code=proc.returncode,
               leads=leads, start_to_led_seconds=lead_wait)
    if refresh_log is not None:
        logs = sorted(refresh_log.parent.glob(f"{refresh_log.name}.*"))
        starts, per_key = _log_starts(logs)
        out["g1"] = lost_updates({k: [t_loaded] for k in keys}, starts, scheduled, per_key)
    return out


async def _wait_led(r: Any, space: KeySpace, n: int) -> dict[str, int]:
    """Wait until every shard is led by one of ``n`` distinct holders (60 s), then up to
    20 s more until they hold as even a share as they can (a process that took every shard
    hands one back about every half lease); the shards each leads."""
    async def held() -> dict[str, int]:
        values = await asyncio.gather(*(r.get(sk.leader) for sk in space.all_shards()))
        counts: dict[str, int] = defaultdict(int)
        for v in values:
            counts[str(v).split("|", 1)[-1] if v else ""] += 1
        return counts

    async def led() -> bool:
        counts = await held()
        return "" not in counts and len(counts) == n
    await _wait_for(led, 60, f"{n} processes leading the shards")

    async def even() -> bool:
        counts = await held()
        return "" not in counts and max(counts.values()) <= math.ceil(space.shards / n)
    with contextlib.suppress(RuntimeError):  # uneven: measured as it is, the leads recorded
        await _wait_for(even, 20, "an even share of the shards")
    return dict(await held())


async def _time_drain(r: Any, space: KeySpace, total: int,
                      meter: Callable[[], CpuMeter]) -> dict[str, Any]:
    """From the first key acked to none pending or in flight (bounded: 120 s); the CPU
    used meanwhile."""
    async def left() -> int:
        shards = space.all_shards()
        counts = await asyncio.gather(*(r.zcard(sk.due(RULE)) for sk in shards),
                                      *(r.zcard(sk.inflight(RULE)) for sk in shards))
        return sum(counts)
    deadline = time.monotonic() + 120
    while await left() >= total and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    t_first = time.time()
    cpu = meter()
    while await left() > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    t_done = time.time()
    remaining = await left()
    return {"per_second": (total - remaining) / max(1e-9, t_done - t_first),
            "drain_seconds": t_done - t_first, "not_drained": remaining,
            "cpu": cpu.done(t_done - t_first, total - remaining)}


async def _scheduled(r: Any, space: KeySpace) -> set[str]:
    keys: set[str] = set()
    for sk in space.all_shards():
        for zset in (sk.due(RULE), sk.inflight(RULE)):
            keys.update(str(k) for k in await r.zrange(zset, 0, -1))
    return keys


# -- a 3-master Redis Cluster --------------------------------------------------------------


CLUSTER_MASTERS = 3
CLUSTER_SHARDS = 16  # each shard's keys share one slot (hash tag); the shards spread over masters
CLUSTER_PROCESSES = 2


async def cluster_coalescer(server: Server, sizes: Sizes, tmp: Path) -> dict[str, Any]:
    """On a local 3-master Cluster (started here): distinct keys/s from one writer process,
    then the drain of ``run --processes 2`` at the default and at the tuned concurrency,
    with lost updates; and the same default-concurrency drain on ``server`` (one server,
    same rules and shards), so the section compares the two in the same run."""
    folder = tmp / f"cluster-{free_port()}"
    with start_cluster(folder / "servers", CLUSTER_MASTERS) as cluster:
        out: dict[str, Any] = {"masters": CLUSTER_MASTERS, "shards": CLUSTER_SHARDS,
                               "processes": CLUSTER_PROCESSES}
        out["distinct"] = await _cluster_distinct(cluster, sizes.distinct)
        for name, conc, masters in (
                ("drain_default_one_server", DEFAULT_CONCURRENCY, [server]),
                ("drain_default", DEFAULT_CONCURRENCY, cluster.nodes),
                ("drain", sizes.drain_concurrency, cluster.nodes)):
            out[name] = await _cluster_drain(masters, sizes, folder / name, conc)
    out["drain_default_ratio"] = (out["drain_default"]["per_second"]
                                  / out["drain_default_one_server"]["per_second"])
    return out


async def _cluster_drain(masters: list[Server], sizes: Sizes, run: Path,
                         conc: int) -> dict[str, Any]:
    """The drain of ``run --processes 2`` on ``masters`` (flushed first), 16 shards."""
    await asyncio.to_thread(_flushall, masters)
    run.mkdir(parents=True)
    rules = run / "rules.yaml"
    rules.write_text(rules_text(window=PROCESS_WINDOW, max_wait="10s", concurrency=conc,
                                shards=CLUSTER_SHARDS, handler="bench.probe:buffered"))
    out = await _drain_with(masters, sizes.drain_keys, rules, CLUSTER_PROCESSES,
                            shards=CLUSTER_SHARDS, refresh_log=run / "refresh.log")
    out["concurrency"] = conc
    return out


async def _cluster_distinct(cluster: Cluster, n: int) -> dict[str, Any]:
    keys = [key(i) for i in range(n)]
    cfg = config(window="1h", max_wait="2h", shards=CLUSTER_SHARDS)
    async with Coalescer(cfg, redis_url=cluster.url, worker=False, node_id="bench-node") as c:
        out = await _distinct_into(c, keys, CpuMeter(*cluster.nodes))
        space = KeySpace(NS, CLUSTER_SHARDS)
        held = await asyncio.gather(*(c.redis.zcard(sk.due(RULE)) for sk in space.all_shards()))
        out["redis_holds"] = sum(held)
        out["keys_per_master"] = [await asyncio.to_thread(_dbsize, node) for node in cluster.nodes]
    return out


def _dbsize(server: Server) -> int:
    with server.client() as c:
        return int(c.dbsize())
