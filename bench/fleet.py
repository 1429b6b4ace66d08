"""A fleet of worker node processes on a local 3-master Redis Cluster.

    .venv/bin/python -m bench.fleet [--quick] [--nodes 16] [--shards 1024]
    .venv/bin/python -m bench.run --only fleet [--quick]     # the same, in the table

Starts three cluster-enabled valkey-servers (``bench.valkey.start_cluster``, 127.0.0.1)
and real ``coalescer run`` processes (leader_lease 3 s, ``shards: 1024``, a handler
that records each refresh start and its due time: ``bench.fleet_probe:record``), then
prints, step by step:

(a) converge: every node started at once; seconds until every node leads an even share
    (``ceil(shards / nodes)`` or one less), and the share per node;
(c) idle: commands/s the three masters ran (``INFO commandstats``, commands inside
    scripts included) over a quiet window of whole lease periods (every node renews on
    the same instants: a window of another length counts a renewal more or less of
    each), by command;
(d) load: distinct keys touched by one writer at 5,000/s (window 500 ms: 5,000 due
    keys/s) for a while; refreshes per node, start lag p50 / p99 (lag = refresh start
    minus due time) and keys never refreshed;
(b) failover: the leader of shard 0 is SIGKILLed; seconds until the other nodes lead
    every shard it led;
(e) grow: a fresh fleet of 4 nodes, then 12 more started one by one under the same load
    (keys from a pool, touched again and again); every touched key must be refreshed
    after its last touch: touches, keys, refreshes, lost (none refreshed after its last
    touch), and seconds until the 16 lead even shares;
(f) reshard: 16 nodes on ``shards: 64`` under the pool load, then a rolling deploy of
    ``shards: 1024`` (each node stopped and started again on the new file, the first
    one back begins a live reshard): seconds until the reshard ended, keys moved, and
    every touched key refreshed after its last touch (lost: none may be).

Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import RedisCluster

from coalescer import Coalescer
from coalescer.config.rules import Config
from coalescer.query.status import gather_status
from coalescer.store.keys import KeySpace, layout
from coalescer.worker.node_lease import RENEW_SHARE

from .common import NS, Sizes, flushall, key, rules_text, spawn_node, stop_process
from .fleet_probe import read_records
from .valkey import Cluster, Server, calls_delta, commandstats, start_cluster

NODES = 16
SHARDS = 1024
MASTERS = 3
LEASE = 3.0  # leader_lease, seconds
RATE = 5_000  # due keys/s of the load
WINDOW = "500ms"
GROW_FROM = 4
POOL = 30_000  # keys the growth load touches again and again
TARGET_S = 10.0  # seconds after the start the shares should be even by
RESHARD_FROM, RESHARD_TO = 64, 1024
CONVERGE_TIMEOUT = 90.0  # seconds: a step that takes longer is reported as not converged
DRAIN_TIMEOUT = 60.0


@dataclass(frozen=True)
class Plan:
    """How long each step runs (``quick()``: shorter)."""

    idle_periods: int = 9  # the idle window, in lease periods (leases renew on the same instants)
    settle_seconds: float = 5.0
    load_seconds: float = 15.0
    grow_every: float = 1.0  # seconds between node starts while growing
    grow_after: float = 5.0  # seconds of load after the last node started

    @classmethod
    def quick(cls) -> Plan:
        return cls(idle_periods=4, settle_seconds=3.0, load_seconds=6.0, grow_every=0.5,
                   grow_after=3.0)


@dataclass
class Fleet:
    """Node processes on one cluster, and the files they write."""

    cluster: Cluster
    folder: Path
    shards: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    rules: Path = field(init=False)

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rules = self.folder / "rules.yaml"
        self.rules.write_text(rules_text(shards=self.shards, lease=f"{LEASE:g}s", window=WINDOW,
                                         max_wait="5s", handler="bench.fleet_probe:record"))

    @property
    def config(self) -> Config:
        return Config.from_yaml(self.rules)

    def log(self, name: str) -> Path:
        return self.folder / f"refresh-{name}.log"

    def start(self, name: str) -> None:
        self.procs[name] = spawn_node(self.cluster.url, self.rules, name, self.log(name),
                                      self.folder / f"node-{name}.out")

    def stop(self, name: str) -> None:
        """SIGTERM one node and wait for it (it releases its shards)."""
        stop_process(self.procs.pop(name))

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()

    def records(self, names: list[str]) -> dict[str, list[tuple[float, int, str]]]:
        return {name: read_records(self.log(name)) for name in names}


async def leaders(r: Any, shards: int) -> list[str | None]:
    """The node leading each shard (None: no leader), read in one cluster pipeline."""
    pipe = r.pipeline()
    for sk in KeySpace(NS, shards).all_shards():
        pipe.get(sk.leader)
    return [str(v).split("|", 1)[1] if v else None for v in await pipe.execute()]


def even(led: list[str | None], nodes: list[str]) -> bool:
    """Every shard led by one of ``nodes``, each leading the fair share or one less."""
    share = math.ceil(len(led) / len(nodes))
    counts = Counter(led)
    return None not in counts and set(counts) <= set(nodes) \
        and all(share - 1 <= counts[n] <= share for n in nodes)


async def until_even(r: Any, shards: int, nodes: list[str], t0: float) -> dict[str, Any]:
    """Poll the leaders until ``nodes`` lead even shares (or CONVERGE_TIMEOUT); also the
    shares at the first read past TARGET_S."""
    at_target: dict[str, Any] | None = None
    while True:
        led = await leaders(r, shards)
        now = time.monotonic()
        counts = Counter(led)
        if at_target is None and now - t0 >= TARGET_S:
            shares = [counts[n] for n in nodes]
            at_target = {"min": min(shares), "max": max(shares), "unled": counts[None]}
        if even(led, nodes) or now - t0 > CONVERGE_TIMEOUT:
            return {"converged": even(led, nodes), "seconds": now - t0,
                    "shares": {n: counts[n] for n in nodes}, "unled": counts[None],
                    "at_target": at_target}
        await asyncio.sleep(0.2)


# -- the steps -------------------------------------------------------------------------------


async def converge(fleet: Fleet, r: Any, names: list[str]) -> dict[str, Any]:
    """(a) Start every node at once; time until they lead even shares."""
    t0 = time.monotonic()
    for name in names:
        fleet.start(name)
    return await until_even(r, fleet.shards, names, t0)


async def idle(fleet: Fleet, seconds: float) -> dict[str, Any]:
    """(c) Commands/s the masters ran while the fleet idled (nothing pending)."""
    clients = [m.client() for m in fleet.cluster.nodes]
    try:
        before = [commandstats(c) for c in clients]
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        wall = time.monotonic() - t0
        after = [commandstats(c) for c in clients]
    finally:
        for c in clients:
            c.close()
    deltas = [calls_delta(b, a) for b, a in zip(before, after, strict=True)]
    by_command: Counter[str] = Counter()
    for d in deltas:
        by_command.update(d)
    return {"seconds": wall, "per_second": sum(by_command.values()) / wall,
            "per_master": [sum(d.values()) / wall for d in deltas],
            "by_command": {k: v / wall for k, v in by_command.most_common()},
            "nodes": len(fleet.procs)}


class Load:
    """One writer touching keys at ``rate``/s in 10 ms ticks, noting each key's last touch
    (this host's clock, taken before the touch)."""

    def __init__(self, writer: Coalescer, rate: int, pool: int = 0, start: int = 0) -> None:
        self.last: dict[str, float] = {}
        self.touches = 0
        self._writer, self._rate, self._pool, self._next = writer, rate, pool, start
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    def _key(self) -> str:
        if self._pool:
            return key(random.randrange(self._pool))
        self._next += 1
        return key(self._next)

    async def _run(self) -> None:
        t0, sent = time.monotonic(), 0
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * self._rate)
            now = time.time()
            for _ in range(due - sent):
                k = self._key()
                self.last[k] = now
                self._writer.touch(k)
            self.touches += max(0, due - sent)
            sent = max(sent, due)
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        await self._task
        await self._writer.flush()

    def refreshed(self, records: dict[str, list[tuple[float, int, str]]]) -> dict[str, Any]:
        """What the nodes' ``records`` say of the touches: how many, refreshes, and the
        keys lost (none of their refreshes started after their last touch)."""
        latest: dict[str, float] = {}
        for rows in records.values():
            for t, _, k in rows:
                latest[k] = max(latest.get(k, 0.0), t)
        lost = [k for k, touched in self.last.items() if latest.get(k, 0.0) <= touched]
        return {"touches": self.touches, "keys": len(self.last),
                "refreshes": sum(len(v) for v in records.values()), "lost": len(lost),
                "lost_sample": lost[:5]}


async def drained(writer: Coalescer, config: Config) -> bool:
    """Nothing pending or in flight in any shard (as `coalescer status` reads it)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        status = await gather_status(writer.redis, config)
        if all(r["pending"] == 0 and r["in_flight"] == 0 for r in status["rules"].values()):
            return True
        await asyncio.sleep(0.25)
    return False


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(fleet: Fleet, writer: Coalescer, names: list[str], seconds: float,
               rate: int) -> dict[str, Any]:
    """(d) Distinct keys at ``rate``/s for ``seconds``: refreshes per node, start lag."""
    counts_before = {n: len(fleet.records([n])[n]) for n in names}
    feed = Load(writer, rate)
    await asyncio.sleep(seconds)
    await feed.stop()
    empty = await drained(writer, fleet.config)
    await asyncio.sleep(2 * 0.25)  # the handlers' last batches are written
    records = fleet.records(names)
    lags, per_node, refreshed = [], {}, set()
    for name, rows in records.items():
        mine = rows[counts_before[name]:]
        per_node[name] = len(mine)
        for start, due_ms, k in mine:
            lags.append(start * 1000 - due_ms)
            refreshed.add(k)
    return {"seconds": seconds, "rate": rate, "touched": len(feed.last),
            "refreshes": sum(per_node.values()), "per_node": per_node,
            "never_refreshed": len(set(feed.last) - refreshed), "drained": empty,
            "lag_p50_ms": _pct(lags, 0.5), "lag_p99_ms": _pct(lags, 0.99),
            "lag_max_ms": max(lags, default=math.nan)}


async def failover(fleet: Fleet, r: Any) -> dict[str, Any]:
    """(b) SIGKILL the leader of shard 0: seconds until the others lead all its shards."""
    led = await leaders(r, fleet.shards)
    victim = str(led[0])
    theirs = [i for i, n in enumerate(led) if n == victim]
    t_kill = time.monotonic()
    fleet.kill(victim)
    while True:
        now = await leaders(r, fleet.shards)
        took = time.monotonic() - t_kill
        if all(now[i] not in (None, victim) for i in theirs) or took > 30:
            break
        await asyncio.sleep(0.01)
    return {"victim": victim, "moved": len(theirs), "takeover_s": took, "lease_s": LEASE,
            "complete": all(now[i] not in (None, victim) for i in theirs)}


async def grow(fleet: Fleet, r: Any, writer: Coalescer, plan: Plan, *, nodes: int,
               rate: int) -> dict[str, Any]:
    """(e) 4 nodes, then up to ``nodes`` one by one under load: every touch refreshed?"""
    first = [f"g{i:02d}" for i in range(GROW_FROM)]
    start = await converge(fleet, r, first)
    feed = Load(writer, rate, pool=POOL)
    await asyncio.sleep(plan.grow_every * 2)
    names = list(first)
    t_grow = time.monotonic()
    for i in range(GROW_FROM, nodes):
        names.append(f"g{i:02d}")
        fleet.start(names[-1])
        await asyncio.sleep(plan.grow_every)
    grown = await until_even(r, fleet.shards, names, t_grow)
    await asyncio.sleep(plan.grow_after)
    await feed.stop()
    empty = await drained(writer, fleet.config)
    fleet.stop_all()  # their last records are written at exit
    records = fleet.records(names)
    return {"from": GROW_FROM, "to": nodes, "start": start, "grown": grown,
            **feed.refreshed(records), "per_node": {n: len(v) for n, v in records.items()},
            "drained": empty}


async def reshard_under_load(cluster: Cluster, r: Any, tmp: Path, plan: Plan, *,
                             nodes: int, rate: int) -> dict[str, Any]:
    """(f) ``nodes`` nodes on ``shards: 64`` under the pool load, then a rolling deploy
    of a rules file with ``shards: 1024``: each node is stopped and started again on it
    (the first one back begins the live reshard). Every touched key must be refreshed
    after its last touch."""
    fleet = Fleet(cluster, tmp / "reshard", RESHARD_FROM)
    names = [f"r{i:02d}" for i in range(nodes)]
    try:
        async with _writer(fleet) as writer:
            start = await converge(fleet, r, names)
            feed = Load(writer, rate, pool=POOL)
            await asyncio.sleep(plan.grow_every * 2)
            old_rules, fleet.rules = fleet.rules, fleet.folder / "rules-1024.yaml"
            fleet.rules.write_text(old_rules.read_text().replace(
                f"shards: {RESHARD_FROM}", f"shards: {RESHARD_TO}"))
            t0 = time.monotonic()
            for name in names:  # a rolling deploy: one node at a time
                fleet.stop(name)
                fleet.start(name)
                await asyncio.sleep(plan.grow_every)
            done = await until_resharded(r, t0)
            await asyncio.sleep(plan.grow_after)
            await feed.stop()
            empty = await drained(writer, fleet.config)
            fleet.stop_all()
            records = fleet.records(names)
    finally:
        fleet.stop_all()
    lags = [t * 1000 - due_ms for rows in records.values() for t, due_ms, _ in rows]
    return {"from": RESHARD_FROM, "to": RESHARD_TO, "nodes": nodes, "start": start,
            "reshard_s": done["seconds"], "resharded": done["done"], "moved": done["moved"],
            **feed.refreshed(records), "drained": empty, "lag_p99_ms": _pct(lags, 0.99)}


async def until_resharded(r: Any, t0: float) -> dict[str, Any]:
    """Poll the namespace's layout until a reshard to RESHARD_TO ended."""
    while True:
        found = await r.hgetall(layout(NS))
        ended = found.get("shards") == str(RESHARD_TO) and found.get("from") == "0"
        if ended or time.monotonic() - t0 > CONVERGE_TIMEOUT:
            return {"done": ended, "seconds": time.monotonic() - t0,
                    "moved": int(found.get("moved", 0))}
        await asyncio.sleep(0.1)


# -- the whole run ---------------------------------------------------------------------------


def _writer(fleet: Fleet) -> Coalescer:
    return Coalescer(fleet.config, redis_url=fleet.cluster.url, worker=False,
                     node_id="fleet-writer")


async def run(tmp: Path, plan: Plan, *, nodes: int = NODES, shards: int = SHARDS,
              rate: int = RATE, report: bool = False) -> dict[str, Any]:
    """Every step on one local cluster; ``report``: print each step's figures as it ends."""
    out: dict[str, Any] = {"nodes": nodes, "shards": shards, "masters": MASTERS,
                           "lease_s": LEASE, "rate": rate}
    show = _print if report else (lambda *_: None)
    with start_cluster(tmp / "servers", MASTERS) as cluster:
        r = RedisCluster.from_url(cluster.url, decode_responses=True)
        fleet = Fleet(cluster, tmp / "fleet", shards)
        try:
            names = [f"n{i:02d}" for i in range(nodes)]
            out["converge"] = await converge(fleet, r, names)
            show("converge", out)
            await asyncio.sleep(plan.settle_seconds)
            out["idle"] = await idle(fleet, plan.idle_periods * LEASE * RENEW_SHARE)
            show("idle", out)
            async with _writer(fleet) as writer:
                out["load"] = await load(fleet, writer, names, plan.load_seconds, rate)
                show("load", out)
            out["failover"] = await failover(fleet, r)
            show("failover", out)
            fleet.stop_all()
            await asyncio.to_thread(flushall, cluster.nodes)
            grow_fleet = Fleet(cluster, tmp / "grow", shards)
            try:
                async with _writer(grow_fleet) as writer:
                    out["grow"] = await grow(grow_fleet, r, writer, plan, nodes=nodes, rate=rate)
                    show("grow", out)
            finally:
                grow_fleet.stop_all()
            await asyncio.to_thread(flushall, cluster.nodes)
            out["reshard"] = await reshard_under_load(cluster, r, tmp, plan, nodes=nodes,
                                                      rate=rate)
            show("reshard", out)
        finally:
            fleet.stop_all()
            await r.aclose()
    return out


async def fleet_coalescer(server: Server, sizes: Sizes, tmp: Path) -> dict[str, Any]:
    """bench.run's measurement (``server`` is not used: the fleet starts its cluster)."""
    quick = sizes == Sizes.quick()
    folder = Path(tempfile.mkdtemp(prefix="fleet-", dir=tmp))
    out = await run(folder, Plan.quick() if quick else Plan())
    return _flat(out)


def _flat(out: dict[str, Any]) -> dict[str, Any]:
    """The figures bench.run's table reads, beside the whole result."""
    figures = {"converge_s": out["converge"]["seconds"],
               "idle_per_second": out["idle"]["per_second"],
               "takeover_s": out["failover"]["takeover_s"],
               "lag_p99_ms": out["load"]["lag_p99_ms"],
               "grow_counts": {"lost": out["grow"]["lost"],
                                   "touches": out["grow"]["keys"]},
               "reshard_counts": {"lost": out["reshard"]["lost"],
                                  "touches": out["reshard"]["keys"]},
               "reshard_s": out["reshard"]["reshard_s"]}
    return {**out, **figures}


# -- printing ---------------------------------------------------------------------------------


def _shares(shares: dict[str, int]) -> str:
    return " ".join(f"{n}:{c}" for n, c in shares.items())


def _at_target(res: dict[str, Any]) -> str:
    at = res["at_target"]
    if at is None:
        return ""
    return (f"; at {TARGET_S:g} s a node led {at['min']} to {at['max']} shards, "
            f"{at['unled']} unled")


def _print(step: str, out: dict[str, Any]) -> None:
    res = out[step]
    if step == "converge":
        print(f"(a) converge: {out['nodes']} nodes, {out['shards']} shards: "
              f"{'even shares' if res['converged'] else 'NOT even'} after {res['seconds']:.1f} s "
              f"(target <= {TARGET_S:g} s{_at_target(res)}); shares: {_shares(res['shares'])}",
              flush=True)
    elif step == "idle":
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(res["by_command"].items())[:6])
        print(f"(c) idle: {res['per_second']:.1f} Redis commands/s over the {MASTERS} masters "
              f"(server-counted, {res['nodes']} nodes, {res['seconds']:.0f} s; target <= 50); "
              f"per master {' / '.join(f'{v:.1f}' for v in res['per_master'])}; top: {top}",
              flush=True)
    elif step == "load":
        per = list(res["per_node"].values())
        print(f"(d) load: {res['rate']:,} due keys/s for {res['seconds']:g} s: "
              f"{res['refreshes']:,} refreshes of {res['touched']:,} keys "
              f"({res['never_refreshed']} never refreshed); per node min / median / max "
              f"{min(per)} / {statistics.median(per):g} / {max(per)}; start lag p50 "
              f"{res['lag_p50_ms']:.1f} ms, p99 {res['lag_p99_ms']:.1f} ms, max "
              f"{res['lag_max_ms']:.1f} ms", flush=True)
        print(f"    refreshes per node: {_shares(res['per_node'])}", flush=True)
    elif step == "failover":
        print(f"(b) failover: {res['victim']} SIGKILLed, its {res['moved']} shards led by "
              f"others after {res['takeover_s']:.2f} s (lease {res['lease_s']:g} s; target <= "
              f"{res['lease_s'] + 0.5:g} s){'' if res['complete'] else ' NOT COMPLETE'}",
              flush=True)
    elif step == "grow":
        g = res["grown"]
        print(f"(e) grow {res['from']} -> {res['to']} nodes under {out['rate']:,} touches/s: "
              f"{res['touches']:,} touches of {res['keys']:,} keys, {res['refreshes']:,} "
              f"refreshes, lost {res['lost']} (keys not refreshed after their last touch; "
              f"target 0); even shares {g['seconds']:.1f} s after the first new node "
              f"({'converged' if g['converged'] else 'NOT converged'}: {_shares(g['shares'])})",
              flush=True)
    elif step == "reshard":
        print(f"(f) reshard {res['from']} -> {res['to']} shards under {out['rate']:,} "
              f"touches/s, a rolling deploy of {res['nodes']} nodes: "
              f"{'ended' if res['resharded'] else 'NOT ended'} {res['reshard_s']:.1f} s after "
              f"the first restart, {res['moved']:,} keys moved; {res['touches']:,} touches "
              f"of {res['keys']:,} keys, {res['refreshes']:,} refreshes, lost {res['lost']} "
              f"(target 0); start lag p99 {res['lag_p99_ms']:.0f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--shards", type=int, default=SHARDS)
    parser.add_argument("--rate", type=int, default=RATE, help="due keys/s of the load")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    with tempfile.TemporaryDirectory(prefix="coalescer-fleet-") as tmp:
        asyncio.run(run(Path(tmp), Plan.quick() if args.quick else Plan(), nodes=args.nodes,
                        shards=args.shards, rate=args.rate, report=True))


if __name__ == "__main__":
    main()
