"""What every benchmark workload shares: the sizes of a run, the rules and a coalescer on
a fresh server, clocks, pacing, settling, lost updates and percentiles, CPU meters, and
``coalescer run`` node processes (start, stop, wait, kill).

Clocks: touch and refresh start times are this host's ``time.time()``; coalescer's due
times (server clock) are converted with the offset measured by ``TIME``. Every loop is
bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from redis.asyncio import Redis

from coalescer import BackpressureError, Coalescer, Config
from coalescer.store.keys import KeySpace

from . import probe
from .baseline import Baseline
from .probe import REC
from .valkey import (
    MonitorCounter,
    Server,
    calls_delta,
    commandstats,
    server_cpu,
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


class ModuleSizes(Protocol):
    """A bench module's own sizes: full by default, ``quick()`` smaller."""

    def __init__(self) -> None: ...

    @classmethod
    def quick(cls) -> Self: ...


SizesT = TypeVar("SizesT", bound=ModuleSizes)


def module_sizes(sizes: Sizes, name: str, kind: type[SizesT]) -> SizesT:
    """The sizes of a bench module for this run: those a test set on it
    (``sizes.NAME``, the module's tiny ones), else quick on a quick run, else full."""
    found = getattr(sizes, name, None)
    if isinstance(found, kind):
        return found
    return kind.quick() if sizes.million < Sizes().million else kind()


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


async def touch_distinct(c: Coalescer, keys: Iterable[str],
                         items: Iterable[str | None] | None = None, *,
                         delay: float | None = None) -> int:
    """Touch each key once (with its item of ``items``; ``delay`` s ahead, else a window
    on), yielding every 1000 so the flusher writes meanwhile; how many touches the full
    buffer refused first."""
    refused = 0
    touch = c.touch
    for i, (k, item) in enumerate(zip(keys, items or itertools.repeat(None), strict=False)):
        for _ in range(10_000):  # bounded: back-pressure only while Redis catches up
            try:
                touch(k, item, delay=delay)
                break
            except BackpressureError:
                refused += 1
                await asyncio.sleep(0.001)
        if i % 1000 == 999:
            await asyncio.sleep(0)
    return refused


async def idle_commands(server: Server, idle: Callable[[], AbstractAsyncContextManager[Any]],
                        settle_s: float, seconds: float) -> dict[str, Any]:
    """Redis commands (MONITOR) while what ``idle()`` starts sits idle: ``settle_s`` to
    start and settle, then ``seconds`` counted."""
    mon = MonitorCounter(server.port)
    try:
        async with idle():
            await asyncio.sleep(settle_s)
            t0 = time.time()
            await asyncio.sleep(seconds)
            t1 = time.time()
        counted = mon.count(t0, t1)
    finally:
        mon.close()
    return idle_figures(counted, t0, t1)


def idle_figures(counted: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """An idle measurement's figures from ``MonitorCounter.count`` over ``t0`` to ``t1``."""
    return {"seconds": t1 - t0, "commands": counted["top"],
            "per_second": counted["top"] / (t1 - t0), "by_command": counted["by_command"]}


# -- node processes ------------------------------------------------------------------------


def node_env(log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(WORK_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env["BENCH_REFRESH_LOG"] = str(log)
    env.pop("COALESCER_REDIS_URL", None)
    return env


def spawn(cmd: list[str], log: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as f:
        return subprocess.Popen(cmd, env=node_env(log), cwd=str(log.parent),
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def spawn_node(url: str, rules: Path, name: str, log: Path, out: Path, *,
               grace: float = 2, args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """A ``coalescer run`` node process (``args`` added) on ``rules``, no HTTP, its
    refreshes logged to ``log`` (bench.probe's handlers) and its output to ``out``."""
    exe = str(Path(sys.executable).parent / "coalescer")
    return spawn([exe, "run", *args, "--rules", str(rules), "--redis", url, "--http", "off",
                  "--node-id", name, "--grace", f"{grace:g}"], log, out)


class NodePair:
    """Two node processes on one rules file in ``folder``: A, the leader, then B, the
    standby; each logs its refreshes to ``logs[name]``."""

    def __init__(self, url: str, rules: Path) -> None:
        self.url, self.rules, self.folder = url, rules, rules.parent
        self.logs = {n: self.folder / f"refresh-{n}.log" for n in "AB"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    async def start(self, r: Any, timeout: float) -> None:
        """Start A, wait until it leads (``r``: a client, sync or async), then B, and
        wait for its heartbeat."""
        for n in "AB":
            self.procs[n] = spawn_node(self.url, self.rules, n, self.logs[n],
                                       self.folder / f"node-{n}.out")
            if n == "A":
                await wait_for(lambda: r.get(SHARD.leader), timeout, "a leader")
        await wait_for(lambda: r.zscore(SHARD.nodes, "B"), timeout, "the standby's heartbeat")

    async def kill_leader(self, r: Any) -> tuple[str, str, float, float]:
        """SIGKILL the node that leads: its name, the other's, the kill's time and the
        other's first refresh after it."""
        leader = await wait_for(lambda: r.get(SHARD.leader), 1, "the leader")
        holder = str(leader).split("|", 1)[1]
        standby = "B" if holder == "A" else "A"
        t_kill, t_first = await kill_and_time(self.procs[holder], self.logs[standby], "standby")
        return holder, standby, t_kill, t_first

    def stop(self) -> None:
        for p in self.procs.values():
            stop_process(p)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


async def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


async def kill_and_time(victim: subprocess.Popen[bytes], other_log: Path,
                         other: str) -> tuple[float, float]:
    """SIGKILL ``victim``; return the kill time and the other node's first refresh after it."""
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)

    def first_after() -> float | None:
        after = [t for t, _ in probe.read_log(other_log) if t > t_kill]
        return min(after) if after else None
    t_first = await wait_for(first_after, 15, f"the {other}'s first refresh")
    return t_kill, float(t_first)


def log_starts(logs: Iterable[Path]) -> tuple[dict[str, float], dict[str, int]]:
    starts: dict[str, float] = {}
    per_key: dict[str, int] = defaultdict(int)
    for log in logs:
        for t, k in probe.read_log(log):
            starts[k] = max(t, starts.get(k, t))
            per_key[k] += 1
    return starts, per_key


def flushall(masters: list[Server]) -> None:
    for server in masters:
        with server.client() as c:
            c.flushall()


async def wait_led(r: Any, space: KeySpace, n: int) -> dict[str, int]:
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
    await wait_for(led, 60, f"{n} processes leading the shards")

    async def even() -> bool:
        counts = await held()
        return "" not in counts and max(counts.values()) <= math.ceil(space.shards / n)
    with contextlib.suppress(RuntimeError):  # uneven: measured as it is, the leads recorded
        await wait_for(even, 20, "an even share of the shards")
    return dict(await held())
