"""Schedules at the delayed-task systems' sizes: 10,000,000 keys up to 365 days ahead.

``python -m bench.schedules_10m`` (about 10 minutes at the default size; ``--keys 1000000``
for a quick look) measures, for coalescer and the baseline design side by side, each on
a fresh server of its own:

- Redis memory per key with ``--keys`` keys scheduled at random times from 1 hour to
  365 days ahead (``used_memory`` before and after);
- the server time of one schedule (a new key), one reschedule (a scheduled key given a
  new time) and one cancel, with those keys waiting: every command's own execution time
  as the server's SLOWLOG records it (threshold 0), p50/p99/max over ``OPS`` single-key
  calls each;
- the start lag of 10,000 more keys falling due at 1,000 a second meanwhile (one worker);
- at ``maxmemory`` under ``noeviction`` (the limit set to what the server uses), how
  many of ``OOM_DUE`` keys already due still run: taking work out must never need
  memory;
- coalescer only: a leader node process SIGKILLed while keys fall due at 1,000 a second,
  the others still waiting: the standby's first refresh after the kill, keys never
  refreshed (lost) and keys refreshed twice, from the two nodes' logs.

The baseline design: its ZSET of due times (``ZADD``, ``ZREM`` to cancel), polled every
200 ms for 20 keys under a ``SET NX`` lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import common as C
from bench import figures as F
from bench import probe
from bench.baseline import Baseline
from bench.probe import REC
from bench.scheduled import (
    DAY,
    far_times,
    load,
    load_baseline,
    schedule,
    slice_due,
    slice_lag,
    slice_lag_baseline,
    wait_for_starts,
)
from bench.valkey import Server, used_memory
from coalescer import Coalescer, UnwrittenTouchesError
from coalescer.config.rules import Config

OPS = 2_000  # single-key calls timed per kind of operation
OOM_DUE = 2_000  # keys due when the server is put at maxmemory
SLOWLOG_LEN = 100_000  # every command of a timed phase, whatever else the client sends
KILL_AFTER = 4.0  # seconds into the failover slice when the leader is killed
SHARD = C.SHARD
# room for every key: the default quotas (1,000,000 pending keys, 1 GiB) refuse past them
LIMITS = "limits: {pending_keys: 50000000, pending_bytes: 17179869184}\n"


def _rules(**kw: Any) -> str:
    return C.rules_text(**kw) + LIMITS


def _coalescer(server: Server, worker: bool, **kw: Any) -> Coalescer:
    config = Config.from_string(_rules(**kw), source="<bench>")
    return Coalescer(config, redis_url=server.url, worker=worker, node_id="bench-node")


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[int(0.99 * (len(ordered) - 1))],
            "max": ordered[-1], "n": len(ordered)}


class SlowLog:
    """Every command's server-side execution time, from SLOWLOG at threshold 0."""

    def __init__(self, server: Server) -> None:
        self._r = server.client(timeout=60)
        self._r.config_set("slowlog-max-len", SLOWLOG_LEN)

    def start(self) -> None:
        self._r.config_set("slowlog-log-slower-than", 0)
        self._r.slowlog_reset()

    def micros(self, *commands: str) -> list[float]:
        """Execution times (µs) of the named commands since ``start``; stops logging."""
        self._r.config_set("slowlog-log-slower-than", 10_000)
        entries = self._r.slowlog_get(SLOWLOG_LEN)
        wanted = {c.lower() for c in commands}
        out = []
        for e in entries:
            args = e["command"].split() if isinstance(e["command"], bytes | str) else []
            name = (args[0].decode() if isinstance(args[0], bytes) else args[0]) if args else ""
            if name.lower() in wanted:
                out.append(float(e["duration"]))
        return out


async def _coalescer_ops(server: Server, keys: list[str]) -> dict[str, Any]:
    """One flush (one upsert call) per schedule and reschedule; one cancel call each."""
    slow = SlowLog(server)
    rng = random.Random(3)
    out: dict[str, Any] = {}
    async with _coalescer(server, False, window="100ms", max_wait="200ms") as c:
        new = [C.key(-10 - i) for i in range(OPS)]
        olds = rng.sample(keys, OPS)
        for name, batch in (("schedule", new), ("reschedule", olds)):
            slow.start()
            for k in batch:
                c.touch(k, at=time.time() + rng.uniform(3600.0, 365 * DAY))
                await c.flush()
            out[name] = _spread(slow.micros("evalsha"))
        slow.start()
        for k in olds:
            await c.cancel(k)
        out["cancel"] = _spread(slow.micros("evalsha"))
    return out


async def _baseline_ops(server: Server, keys: list[str]) -> dict[str, Any]:
    slow = SlowLog(server)
    rng = random.Random(3)
    out: dict[str, Any] = {}
    async with Baseline(server.url, probe.refresh, delay=0.0) as b:
        olds = rng.sample(keys, OPS)
        for name, batch in (("schedule", [C.key(-10 - i) for i in range(OPS)]),
                            ("reschedule", olds)):
            slow.start()
            for k in batch:
                await b.redis.zadd(b.zset, {k: time.time() + rng.uniform(3600.0, 365 * DAY)})
            out[name] = _spread(slow.micros("zadd"))
        slow.start()
        for k in olds:
            await b.redis.zrem(b.zset, k)
        out["cancel"] = _spread(slow.micros("zrem"))
    return out


async def _load_coalescer(server: Server, keys: list[str]) -> dict[str, Any]:
    async with _coalescer(server, False, window="100ms", max_wait="200ms") as c:
        return await load(c, server.client(timeout=60), keys,
                          far_times(len(keys), days=365, seed=365))


async def _load_baseline(server: Server, keys: list[str]) -> dict[str, Any]:
    async with Baseline(server.url, probe.refresh, delay=0.0) as b:
        return await load_baseline(b, server.client(timeout=60), keys,
                                   far_times(len(keys), days=365, seed=365))


async def _lag_coalescer(server: Server, n: int) -> dict[str, Any]:
    REC.reset(offset_ms=await C.clock_offset_ms(server.url))
    kw = {"window": "100ms", "max_wait": "200ms", "concurrency": F.LAG_CONCURRENCY}
    async with _coalescer(server, True, **kw) as w:
        return await slice_lag(w, n)


async def _lag_baseline(server: Server, n: int) -> dict[str, Any]:
    async with Baseline(server.url, probe.refresh, delay=0.0) as b:
        return await slice_lag_baseline(b, n)


def _at_maxmemory(server: Server) -> Any:
    sync = server.client(timeout=60)
    sync.config_set("maxmemory-policy", "noeviction")
    sync.config_set("maxmemory", used_memory(sync))
    return sync


async def _oom_coalescer(server: Server, n: int) -> dict[str, Any]:
    due = [C.key(n + 100_000 + i) for i in range(OOM_DUE)]
    async with _coalescer(server, False, window="100ms", max_wait="200ms") as c:
        for k in due:
            c.touch(k, at=time.time() + 1.0)
        await c.flush()
    sync = _at_maxmemory(server)
    REC.reset(offset_ms=0.0)
    unwritten = 0
    try:
        async with _coalescer(server, True, window="100ms", max_wait="200ms",
                               concurrency=64) as w:
            await wait_for_starts(OOM_DUE, 30.0)
            left = sync.zcard(SHARD.due(C.RULE)) + sync.zcard(SHARD.inflight(C.RULE))
            w.touch(C.key(n + 99_999))  # refused by the server: stays buffered
    except UnwrittenTouchesError as exc:  # that touch, named by close()
        unwritten = exc.count
    finally:
        sync.config_set("maxmemory", 0)
    return {"due": OOM_DUE, "ran": REC.count, "left_in_redis": left - n,
            "unwritten_at_close": unwritten}


async def _oom_baseline(server: Server, n: int) -> dict[str, Any]:
    due = {C.key(n + 100_000 + i): time.time() + 1.0 for i in range(OOM_DUE)}
    async with Baseline(server.url, probe.refresh, delay=0.0) as b:
        await b.redis.zadd(b.zset, due)
        sync = _at_maxmemory(server)
        REC.reset(offset_ms=0.0)
        try:
            b.start_worker()
            await wait_for_starts(OOM_DUE, 10.0)
        finally:
            sync.config_set("maxmemory", 0)
    return {"due": OOM_DUE, "ran": REC.count}


async def _failover_coalescer(server: Server, n: int, tmp: Path) -> dict[str, Any]:
    """Two node processes; the leader SIGKILLed while a slice falls due at 1,000/s."""
    folder = tmp / "failover"
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yaml"
    rules.write_text(_rules(window="100ms", max_wait="200ms", handler="bench.probe:logged"))
    nodes = C.NodePair(server.url, rules)
    r = server.client(timeout=60)
    try:
        await nodes.start(r, 30)
        slice_keys, slice_times = slice_due(n)
        async with _coalescer(server, False, window="100ms", max_wait="200ms") as c:
            await schedule(c, slice_keys, slice_times)
            await c.flush()
        await asyncio.sleep(max(0.0, slice_times[0] - time.time() + KILL_AFTER))
        holder, standby, t_kill, t_first = await nodes.kill_leader(r)
        await C.wait_for(lambda: time.time() > slice_times[-1] + 8.0, 60, "the slice's end")
    finally:
        nodes.stop()
    by_killed = Counter(k for _, k in probe.read_log(nodes.logs[holder]))
    by_standby = Counter(k for _, k in probe.read_log(nodes.logs[standby]))
    twice = [k for k in slice_keys if by_killed[k] + by_standby[k] > 1]
    # a key the killed node ran but had not yet acknowledged runs again (at least once)
    rerun = [k for k in twice if by_killed[k] == 1 and by_standby[k] == 1]
    return {"killed": holder, "takeover_s": t_first - t_kill, "lease_s": 3.0,
            "slice": len(slice_keys),
            "lost": sum(1 for k in slice_keys if not by_killed[k] + by_standby[k]),
            "run_twice": len(twice) - len(rerun), "rerun_unacked": len(rerun)}


async def _design(name: str, n: int, tmp: Path) -> dict[str, Any]:
    keys = [C.key(i) for i in range(n)]
    out: dict[str, Any] = {}
    with Server(tmp, name=name) as server:
        if name == "coalescer":
            out["load"] = await _load_coalescer(server, keys)
            out["ops"] = await _coalescer_ops(server, keys)
            out["lag"] = await _lag_coalescer(server, n)
            out["failover"] = await _failover_coalescer(server, n + 20_000, tmp)
            out["oom"] = await _oom_coalescer(server, n)
        else:
            out["load"] = await _load_baseline(server, keys)
            out["ops"] = await _baseline_ops(server, keys)
            out["lag"] = await _lag_baseline(server, n)
            out["oom"] = await _oom_baseline(server, n)
    return out


def _table(n: int, res: dict[str, dict[str, Any]]) -> str:
    c, b = res["coalescer"], res["baseline"]
    rows = [("figure", "coalescer", "baseline", "target"),
            (f"Redis memory per key, {n:,} scheduled up to 365 days ahead",
             f"{c['load']['bytes_per_key']:.1f} B", f"{b['load']['bytes_per_key']:.1f} B",
             "<= 150 B")]
    for op in ("schedule", "reschedule", "cancel"):
        cs, bs = c["ops"][op], b["ops"][op]
        rows.append((f"server time of one {op}, p50 / p99 / max",
                     f"{cs['p50']:.0f} / {cs['p99']:.0f} / {cs['max']:.0f} µs",
                     f"{bs['p50']:.0f} / {bs['p99']:.0f} / {bs['max']:.0f} µs", "p99 <= 1 ms"))
    rows.append(("start lag p99, 1,000 due/s meanwhile", f"{c['lag']['p99']:.1f} ms",
                 f"{b['lag']['p99']:.0f} ms", "<= 10 ms"))
    rows.append((f"keys already due that run at maxmemory (noeviction), of {OOM_DUE:,}",
                 f"{c['oom']['ran']:,}", f"{b['oom']['ran']:,}", "all"))
    f = c["failover"]
    rows.append(("leader SIGKILLed: standby's first refresh after the kill",
                 f"{f['takeover_s']:.2f} s (lease {f['lease_s']:.0f} s)", "-",
                 "<= lease + 0.5 s"))
    rows.append((f"... of {f['slice']:,} keys falling due: lost / run twice by live nodes",
                 f"{f['lost']} / {f['run_twice']}", "-", "0 / 0"))
    rows.append(("... run again because the killed node died before its ack",
                 f"{f['rerun_unacked']}", "-", "(at least once)"))
    lines = [rows[0], ("---",) * 4, *rows[1:]]
    return "\n".join("| " + " | ".join(r) + " |" for r in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.schedules_10m", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=10_000_000, help="keys scheduled ahead")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-10m-") as tmp:
        for name in ("coalescer", "baseline"):
            res[name] = asyncio.run(_design(name, args.keys, Path(tmp)))
            print(f"{name}: {json.dumps(res[name])}", flush=True)
    print(_table(args.keys, res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
