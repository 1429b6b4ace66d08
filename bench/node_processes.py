"""The measurements that run ``coalescer run`` node processes: a leader SIGKILLed (and the
baseline's worker process), a drain by N node processes (``run --processes N``) and the
3-master Redis Cluster.

Every function takes a fresh server (``bench.valkey.Server``), the sizes of this run and
a temporary folder, and returns a plain dict for results.json.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from coalescer import Coalescer
from coalescer.store.connection import connect
from coalescer.store.keys import KeySpace

from . import probe
from .baseline import Baseline
from .common import (
    NS,
    RULE,
    SHARD,
    CpuMeter,
    NodePair,
    Sizes,
    baseline_scheduled,
    coalescer,
    coalescer_scheduled,
    config,
    flushall,
    key,
    kill_and_time,
    log_starts,
    lost_updates,
    rules_text,
    settle,
    spawn,
    spawn_node,
    stop_process,
    touch_distinct,
    wait_for,
    wait_led,
)
from .figures import (
    DEFAULT_CONCURRENCY,
    _distinct_into,
)
from .valkey import (
    Cluster,
    Server,
    free_port,
    start_cluster,
)

# -- leader SIGKILL ------------------------------------------------------------------------


FAILOVER_RATE = 50  # distinct keys touched per second while it runs


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


async def failover_coalescer(server: Server, sizes: Sizes, tmp: Path) -> dict[str, Any]:
    folder = tmp / "failover-coalescer"
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yaml"
    rules.write_text(rules_text(window="200ms", max_wait="1s", handler="bench.probe:logged"))
    nodes = NodePair(server.url, rules)
    r = Redis.from_url(server.url, decode_responses=True)
    try:
        await nodes.start(r, 20)
        async with coalescer(server, False, window="200ms", max_wait="1s") as w:
            async def touch(k: str) -> None:
                w.touch(k)
            feed = Feed(touch, FAILOVER_RATE)
            await wait_for(lambda: probe.read_log(nodes.logs["A"]), 10,
                           "refreshes by the leader")
            await asyncio.sleep(1.0)
            holder, standby, t_kill, t_first = await nodes.kill_leader(r)
            await asyncio.sleep(1.0)
            await feed.stop()
            await w.flush()

            async def quiet() -> bool:
                due, inflight = await asyncio.gather(r.zcard(SHARD.due(RULE)),
                                                     r.zcard(SHARD.inflight(RULE)))
                return due + inflight == 0
            await settle(quiet, timeout=15)
            scheduled = await coalescer_scheduled(r)
        starts, per_key = log_starts(nodes.logs.values())
        recovered = await _recovered_count(nodes.logs[standby], feed.touches, t_kill,
                                           nodes.logs[holder])
    finally:
        nodes.stop()
        await r.aclose()
    return {"lease_s": 3.0, "takeover_s": t_first - t_kill, "killed": holder,
            "g1": lost_updates(feed.touches, starts, scheduled, per_key), **recovered}


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
            procs[n] = spawn([sys.executable, "-m", "bench.baseline", "worker", "--redis",
                               server.url, "--log", str(logs[n]), "--delay", "0.2",
                               "--max-seconds", "120"], logs[n], folder / f"node-{n}.out")
        async with Baseline(server.url, delay=0.2) as b:
            feed = Feed(b.touch, FAILOVER_RATE)

            def both() -> bool:
                return all(probe.read_log(logs[n]) for n in "AB")
            await wait_for(both, 20, "refreshes by both baseline workers")
            await asyncio.sleep(1.0)
            last = {n: max(t for t, _ in probe.read_log(logs[n])) for n in "AB"}
            victim = max(last, key=lambda n: last[n])  # the one that refreshed last
            survivor = "B" if victim == "A" else "A"
            t_kill, t_first = await kill_and_time(procs[victim], logs[survivor], "survivor")
            await asyncio.sleep(1.0)
            await feed.stop()
            await settle(lambda: _zero(b), timeout=10)
            scheduled = await baseline_scheduled(b)
        starts, per_key = log_starts(logs.values())
    finally:
        for p in procs.values():
            stop_process(p)
    return {"lock_s": 1.0, "takeover_s": t_first - t_kill,
            "g1": lost_updates(feed.touches, starts, scheduled, per_key)}


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
        await asyncio.to_thread(flushall, [server])
        out[f"processes_{n}"] = await _drain_with([server], sizes.drain_keys, rules, n,
                                                  shards=PROCESS_SHARDS)
    first, last = out[f"processes_{counts[0]}"], out[f"processes_{counts[-1]}"]
    out["per_second"] = last["per_second"]
    out["ratio"] = last["per_second"] / first["per_second"]
    return out


async def _drain_with(masters: list[Server], n_keys: int, rules: Path, n: int, *, shards: int,
                      refresh_log: Path | None = None) -> dict[str, Any]:
    """``coalescer run --processes n`` on ``masters`` (one server, or a cluster's masters),
    once every shard is led: ``n_keys`` keys touched by a write-only coalescer, then the
    time until none is pending or in flight; with ``refresh_log`` (the rules' handler is
    ``bench.probe:buffered``) also the lost updates."""
    folder = rules.parent
    space = KeySpace(NS, shards)
    proc = spawn_node(masters[0].url, rules, f"p{n}", refresh_log or folder / "unused.log",
                      folder / f"processes-{n}.out", grace=5, args=("--processes", str(n)))
    conn = await connect(masters[0].url)  # a RedisCluster client on a cluster
    r = conn.client
    try:
        t_spawn = time.time()
        leads = await wait_led(r, space, n)
        lead_wait = time.time() - t_spawn
        keys = [key(i) for i in range(n_keys)]
        t0 = time.time()
        async with Coalescer.from_yaml(rules, redis_url=masters[0].url, worker=False) as w:
            await touch_distinct(w, keys)
            await w.flush()
        t_loaded = time.time()
        out = await _time_drain(r, space, len(keys), lambda: CpuMeter(*masters, pid=proc.pid))
        scheduled = await _scheduled(r, space) if refresh_log else set()
    finally:
        await conn.close()
        stop_process(proc)
    out.update(processes=n, load_seconds=t_loaded - t0, exit_code=proc.returncode,
               leads=leads, start_to_led_seconds=lead_wait)
    if refresh_log is not None:
        logs = sorted(refresh_log.parent.glob(f"{refresh_log.name}.*"))
        starts, per_key = log_starts(logs)
        out["g1"] = lost_updates({k: [t_loaded] for k in keys}, starts, scheduled, per_key)
    return out


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
    await asyncio.to_thread(flushall, masters)
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
