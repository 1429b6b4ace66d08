"""Run every benchmark figure for coalescer, the baseline design and the peers, side by side.

    .venv/bin/python -m bench.run [--quick] [--only NAME,...] [--json PATH]

Starts its own valkey-server processes (a fresh one per measurement, on
127.0.0.1) and prints ``figure | coalescer | baseline | ratio | target | met``.
Every measurement runs 3 times (``--repeats``), in rounds of every system of its group
(the order reversed every other round), each figure shows min / median /
max, ``ratio`` is the median of coalescer / the median of the baseline, measured
in the same run, and ``met`` means every run met the target. A full run of every
group writes bench/results.json; ``--quick`` or ``--only`` write nothing unless
``--json PATH`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import batches as B
from . import bulk_ops as BO
from . import common as C
from . import fairness as FR
from . import fairness_cap as FC
from . import fairness_rows as FRows
from . import fairness_shards as FS
from . import figures as F
from . import fleet as FL
from . import idle_shards as S
from . import items as I
from . import kafka as K
from . import leading_edge as LE
from . import node_processes as N
from . import outbox as O
from . import peers as P
from . import scheduled as SC
from . import throttle as T
from . import timeline as TL
from .valkey import Server

HERE = Path(__file__).resolve().parent

Measure = Callable[..., Awaitable[dict[str, Any]]]

# name -> (coalescer measurement, baseline measurement, extra positional args)
GROUPS: dict[str, list[tuple[str, Measure, tuple[Any, ...]]]] = {
    "burst": [("coalescer", F.burst_coalescer, ()), ("baseline", F.burst_baseline, ()),
              ("baseline_sliding", F.burst_baseline, (True,)),
              ("arq", P.burst_arq, ()), ("bullmq", P.burst_bullmq, ())],
    "churn": [("coalescer", F.churn_coalescer, ()), ("baseline", F.churn_baseline, ()),
              ("arq", P.churn_arq, ()), ("bullmq", P.churn_bullmq, ())],
    "hot_key": [("coalescer", F.hot_key_coalescer, ()), ("baseline", F.hot_key_baseline, ()),
                ("arq", P.hot_key_arq, ()), ("bullmq", P.hot_key_bullmq, ())],
    "distinct": [("coalescer", F.distinct_coalescer, ()), ("baseline", F.distinct_baseline, (1,)),
                 ("baseline_64", F.distinct_baseline, (64,)),
                 ("arq", P.distinct_arq, ()), ("bullmq", P.distinct_bullmq, ())],
    "commands": [("coalescer", F.commands_coalescer, ()), ("baseline", F.commands_baseline, ())],
    "lag1000": [("coalescer", F.lag_coalescer, (1000,)),
                ("coalescer_default", F.lag_coalescer, (1000, F.DEFAULT_CONCURRENCY)),
                ("baseline", F.lag_baseline, (1000,)),
                ("arq", P.lag_arq, (1000,)), ("bullmq", P.lag_bullmq, (1000,))],
    "lag5000": [("coalescer", F.lag_coalescer, (5000,)),
                ("coalescer_default", F.lag_coalescer, (5000, F.DEFAULT_CONCURRENCY)),
                ("baseline", F.lag_baseline, (5000,))],
    "drain": [("coalescer", F.drain_coalescer, ()),
              ("coalescer_default", F.drain_coalescer, (F.DEFAULT_CONCURRENCY,)),
              ("baseline", F.drain_baseline, ()),
              ("arq", P.drain_arq, ()), ("bullmq", P.drain_bullmq, ())],
    "batches": [("coalescer_batch", B.drain_batch, ()),
                ("coalescer_default", F.drain_coalescer, (F.DEFAULT_CONCURRENCY,))],
    "stats_app": [("coalescer_batch", B.stats_app, ("TMP", "batch")),
                  ("coalescer_per_key", B.stats_app, ("TMP", "per_key"))],
    "processes": [("coalescer", N.drain_processes, ("TMP",))],
    "idle": [("coalescer", F.idle_coalescer, ()), ("baseline", F.idle_baseline, ()),
             ("arq", P.idle_arq, ()), ("bullmq", P.idle_bullmq, ())],
    "idle_shards": [*((f"coalescer_{n}", S.idle, ("TMP", n)) for n in S.SHARD_COUNTS),
                    *((f"failover_{n}", S.failover, ("TMP", n)) for n in S.FAILOVER_COUNTS),
                    *((f"write_{n}", S.write_path, (n,)) for n in S.WRITE_COUNTS)],
    "million": [("coalescer", F.pending_coalescer, ("N",)),
                ("coalescer_small", F.pending_coalescer, ("SMALL",)),
                ("baseline", F.pending_baseline, ("N",)),
                ("baseline_small", F.pending_baseline, ("SMALL",))],
    "scheduled": [("coalescer", SC.scheduled_coalescer, ("N",)),
                  ("baseline", SC.scheduled_baseline, ("N",))],
    "failover": [("coalescer", N.failover_coalescer, ("TMP",)),
                 ("baseline", N.failover_baseline, ("TMP",))],
    "cluster": [("coalescer", N.cluster_coalescer, ("TMP",))],
    "throttle": [("coalescer", T.throttle_coalescer, ("TMP",))],
    "bulk": [("coalescer_touch", T.bulk_touch, ()), ("coalescer_wait", T.bulk_touch_wait, ()),
             ("coalescer_touch_small", T.bulk_touch, (T.SMALL_BUFFER,)),
             ("coalescer_wait_small", T.bulk_touch_wait, (T.SMALL_BUFFER,))],
    "items": [("coalescer_items", I.items_coalescer, ()),
              ("coalescer_hot_key", F.hot_key_coalescer, ()),
              ("coalescer_distinct", F.distinct_coalescer, ())],
    "fleet": [("coalescer", FL.fleet_coalescer, ("TMP",))],
    "outbox": [("coalescer_throughput", O.outbox_throughput, ()),
               ("coalescer_lag", O.outbox_lag, ("TMP",)),
               ("coalescer_cost", O.outbox_cost, ()),
               ("coalescer_kills", O.outbox_kills, ("TMP",))],
    # fairness: fair on (the coalescer column) beside fair off (baseline) in the same run
    "fair_skew": [("coalescer", FR.skew, (True,)), ("baseline", FR.skew, (False,)),
                  ("apart", FR.skew, (False, True))],
    "fair_skew_work": [("coalescer", FR.skew, (True, False, True)),
                       ("baseline", FR.skew, (False, False, True))],
    "fair_balanced": [("coalescer", FR.balanced, (True,)),
                      ("baseline", FR.balanced, (False,))],
    "fair_weights": [("coalescer", FR.weights, (True,)), ("baseline", FR.weights, (False,))],
    "fair_cap": [("coalescer", FC.cap, ("TMP", True)), ("baseline", FC.cap, ("TMP", False))],
    "herd": [("coalescer", FR.herd, ()), ("baseline", FR.herd, (False,))],
    "fair_memory": [("coalescer", FR.memory, (True,)), ("baseline", FR.memory, (False,))],
    # fair across shards: each shard count beside shards: 1, the cap on a server and a Cluster
    "fair_shards": [*((f"{t}_{n}", FS.shares, (t, n)) for t in ("weighted", "equal")
                      for n in FS.SHARD_COUNTS),
                    *((f"quiet_{n}", FS.quiet, (n,)) for n in FS.SHARD_COUNTS),
                    (f"cap_{FS.CAP_SHARDS}", FS.cap, ("TMP", FS.CAP_SHARDS, False)),
                    (f"cap_cluster_{FS.CAP_SHARDS}", FS.cap, ("TMP", FS.CAP_SHARDS, True))],
    # edge: leading (the coalescer column) beside edge: trailing (baseline) in the same run
    "leading": [("coalescer", LE.bursts, ("leading",)), ("baseline", LE.bursts, ("trailing",))],
    # a key's timeline beside explain of the same key, with N keys pending
    "timeline": [("coalescer", TL.answer, ("N",)), ("baseline", TL.answer, ("N", "explain"))],
    "bulk_ops_search": [("coalescer", BO.search, ())],
    "bulk_ops_retry": [("coalescer", BO.retry, ())],
    "kafka": [("coalescer_throughput", K.kafka_throughput, ("TMP",)),
              ("baseline_throughput", K.kafka_baseline, ("TMP",)),
              ("coalescer_burst", K.kafka_burst, ("TMP",)),
              ("baseline_burst", K.kafka_burst_baseline, ("TMP",))],
}


PEERS = ("arq", "bullmq")  # their cells: the figure, and coalescer's median over theirs
REPEATS = 3  # fresh runs of every measurement: the table shows min / median / max
MEASURE_TIMEOUT = 150.0  # seconds: no measurement takes a tenth of this when all is well
GROUP_TIMEOUTS = {"fleet": 600.0, "herd": 600.0, "fair_cap": 600.0,  # measurements that run long
                  "fair_memory": 600.0}
GROUP_TIMEOUTS.update({"bulk_ops_search": 300.0, "bulk_ops_retry": 900.0})


async def run_group(name: str, sizes: C.Sizes, tmp: Path, results: dict[str, Any],
                    repeats: int) -> None:
    """Each system of the group ``repeats`` times, in rounds: every round runs each
    system once, the order reversed every other round, so a drift of the machine over
    the group's minutes (or a warming process) favours no side."""
    out = results.setdefault(name, {})
    systems = GROUPS[name]
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system, _, _ in systems}
    spent = dict.fromkeys(runs, 0.0)
    for i in range(repeats):
        for system, measure, extra in systems if i % 2 == 0 else systems[::-1]:
            if runs[system] and "skipped" in runs[system][-1]:
                continue  # a peer that cannot run here: once is enough
            t0 = time.monotonic()
            runs[system].append(await _measure_once(measure, sizes, tmp, extra,
                                                    run=(name, system, i)))
            spent[system] += time.monotonic() - t0
    for system, found in runs.items():
        out[system] = {"runs": found}
        print(f"  {name}/{system} ... {spent[system]:.1f}s", flush=True)


async def _measure_once(measure: Measure, sizes: C.Sizes, tmp: Path, extra: tuple[Any, ...],
                        *, run: tuple[str, str, int]) -> dict[str, Any]:
    """One measurement, ``run`` = (group, system, round), on a server of its own."""
    name, system, i = run
    args = [sizes.million if a == "N" else sizes.small if a == "SMALL"
            else tmp if a == "TMP" else a for a in extra]
    try:
        fresh_heap()
        with Server(tmp, f"{name}-{system}-{i}") as server:
            timeout = GROUP_TIMEOUTS.get(name, MEASURE_TIMEOUT)
            return await _bounded(measure(server, sizes, *args), name, system, timeout)
    except Exception as exc:  # one broken figure must not hide the others
        logging.exception("%s/%s failed", name, system)
        return {"error": f"{type(exc).__name__}: {exc}"}


def fresh_heap() -> None:
    """Collect, then freeze what survives: the objects earlier measurements left (results,
    imported modules) are not scanned again by the collections made during the next one.
    Without it, full collections of this long-lived bench process paused a measurement
    for 17-30 ms, which a node in a process of its own does not see."""
    gc.collect()
    gc.freeze()


async def _bounded(coro: Awaitable[dict[str, Any]], name: str, system: str,
                   timeout: float = MEASURE_TIMEOUT) -> dict[str, Any]:
    """Run one measurement for at most ``timeout``; a stuck one is reported, not waited on."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait([task], timeout=timeout)
    if task in done:
        return task.result()
    print(f"\n{name}/{system} still running after {timeout:g}s; its tasks:",
          file=sys.stderr)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            t.print_stack(limit=8, file=sys.stderr)
    task.cancel()
    await asyncio.wait([task], timeout=10)
    raise TimeoutError(f"{name}/{system} took over {timeout:g}s")


def run_in_loop(coro: Awaitable[None]) -> None:
    """asyncio.run, except that tasks left stuck after the work are abandoned, not awaited."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=10))
        loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 10))
        loop.close()


# -- the table ---------------------------------------------------------------------------


def _get(d: Any, path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _fmt(v: Any, unit: str = "", digits: int = 0) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if digits == 0 and abs(v) >= 100:
        return f"{v:,.0f}{unit}"
    return f"{v:,.{max(digits, 2) if abs(v) < 10 else max(digits, 1)}f}{unit}"


def _short(v: float) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


@dataclass(frozen=True)
class Spread:
    """One figure over the runs of a measurement."""

    values: list[float]
    lower_bound: bool = False  # some run's value is only a lower bound

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def text(self, fmt: Callable[[float], str]) -> str:
        if len(self.values) == 1:
            return (">=" if self.lower_bound else "") + fmt(self.values[0])
        lo, hi = min(self.values), max(self.values)
        return (">=" if self.lower_bound else "") + f"{fmt(lo)} / {fmt(self.median)} / {fmt(hi)}"


def _ratio(c: Spread | None, b: Spread | None) -> str:
    if c is None or b is None or b.median == 0:
        return "-"
    return f"{c.median / b.median:,.3g}x"


class Rows:
    """The table being built: one row per figure."""

    def __init__(self, res: dict[str, Any], sizes: C.Sizes) -> None:
        self.res = res
        self.sizes = sizes
        self.out: list[dict[str, Any]] = []

    def runs(self, where: str) -> list[dict[str, Any]]:
        """The good runs of "group.system" (an errored run has no figures)."""
        return [r for r in _get(self.res, f"{where}.runs") or [] if "error" not in r]

    def spread(self, where: str, field: str) -> Spread | None:
        runs = [r for r in self.runs(where) if _get(r, field) is not None]
        if not runs:
            return None
        return Spread([float(_get(r, field)) for r in runs],
                      any(_get(r, f"{field}_lower_bound") for r in runs))

    def add(self, figure: str, c: str, b: str, *, ratio: str = "-", target: str = "-",
            met: bool | None = None, peers: dict[str, str] | None = None) -> None:
        row = {"figure": figure, "coalescer": c, "baseline": b, "ratio": ratio}
        row.update({p: "-" for p in PEERS} | {f"vs {p}": "-" for p in PEERS} | (peers or {}))
        row.update(target=target, met="n/a" if met is None else ("yes" if met else "NO"))
        self.out.append(row)

    def skipped(self, where: str) -> str | None:
        """A peer's cell when it has no figure: "-" (not run in this group), "skipped"
        (it cannot run here) or "error" (every run failed); else None."""
        group, peer = where.split(".", 1)
        if peer not in {system for system, _, _ in GROUPS.get(group, [])}:
            return "-"
        runs = _get(self.res, f"{where}.runs") or []
        if any("skipped" in r for r in runs):
            return "skipped"
        return "error" if runs and all("error" in r for r in runs) else None

    def peer_cells(self, group: str, field: str, c: Spread | None,
                   fmt: Callable[[float], str]) -> dict[str, str]:
        """The peers' cells of a row: value (min / median / max) and coalescer / peer."""
        cells: dict[str, str] = {}
        for peer in PEERS:
            where = f"{group}.{peer}"
            spread = self.spread(where, field)
            cells[peer] = self.skipped(where) or (spread.text(fmt) if spread else "n/a")
            cells[f"vs {peer}"] = _ratio(c, spread)
        return cells

    def lost_text(self, where: str, field: str) -> tuple[str, int | None]:
        found = (r if field == "." else _get(r, field) for r in self.runs(where))
        runs = [g for g in found if g and "lost" in g]
        if not runs:
            return "n/a", None
        lost = sum(g["lost"] for g in runs)
        text = f"{lost} of {sum(g['touches'] for g in runs)}"
        late = sum(g.get("late", 0) for g in runs)
        if late:
            text += f" (+{late} late)"
        return text + f" in {len(runs)} runs", lost

    def lost(self, figure: str, cwhere: str, bwhere: str, field: str = "", *,
             peers: bool = True) -> None:
        ctext, clost = self.lost_text(cwhere, field or "g1")
        btext, _ = self.lost_text(bwhere, field or "g1")
        cells = {}
        if peers:
            group = cwhere.split(".", maxsplit=1)[0]
            for peer in PEERS:
                where = f"{group}.{peer}"
                cells[peer] = self.skipped(where) or self.lost_text(where, field or "g1")[0]
        self.add(figure, ctext, btext, target="0", met=None if clost is None else clost == 0,
                 peers=cells)

    def figure(self, figure: str, c: Spread | None, b: Spread | None, *,
               fmt: Callable[[float], str], target: str = "-",
               ok: Callable[[float], bool] | None = None, peers: str = "") -> None:
        """A row; ``ok`` judges each coalescer run (met: every run meets the target);
        ``peers`` "group.field": the peers' figure of that group goes beside it."""
        met = None if ok is None or c is None else all(ok(v) for v in c.values)
        cells = None
        if peers:
            group, field = peers.split(".", 1)
            cells = self.peer_cells(group, field, c, fmt)
        self.add(figure, c.text(fmt) if c else "n/a", b.text(fmt) if b else "n/a",
                 ratio=_ratio(c, b), target=target, met=met, peers=cells)

    def rate(self, figure: str, where: str, base: str, *, target: str,
             ok: Callable[[float], bool], peers: bool = True) -> None:
        """A rate: ``where`` and ``base`` are "group.system"."""
        group = where.split(".", maxsplit=1)[0]
        self.figure(figure, self.spread(where, "per_second"), self.spread(base, "per_second"),
                    fmt=_short, target=target, ok=ok,
                    peers=f"{group}.per_second" if peers else "")


def _at_least(floor: float) -> Callable[[float], bool]:
    return lambda c: c >= floor


def _at_most(ceiling: float) -> Callable[[float], bool]:
    return lambda c: c <= ceiling


def _lost_rows(t: Rows) -> None:
    # the burst's result holds the whole workload; churn and the rest keep it under g1
    t.lost(f"lost updates: {F.BURST_TOUCHES}-touch {F.BURST_SECONDS:g} s burst",
           "burst.coalescer", "burst.baseline", ".")
    t.lost("lost updates: same burst, baseline with sliding dedup",
           "burst.coalescer", "burst.baseline_sliding", ".", peers=False)
    t.lost("lost updates: churn (200 keys, touched while refreshing)",
           "churn.coalescer", "churn.baseline", ".")
    for name in ("lag1000", "lag5000", "drain", "failover"):
        t.lost(f"lost updates: {name} workload", f"{name}.coalescer", f"{name}.baseline",
               peers=False)
    for name in ("lag1000", "lag5000", "drain"):
        t.lost(f"lost updates: {name} workload, default concurrency",
               f"{name}.coalescer_default", f"{name}.baseline")


def _write_path_rows(t: Rows) -> None:
    t.rate("hot-key touch() calls/s, one process", "hot_key.coalescer", "hot_key.baseline",
           target=">= 1,000,000", ok=lambda c: c >= 1_000_000)
    for system, label in (("baseline", "1 writer loop, as coalescer's"),
                          ("baseline_64", "64 concurrent writers")):
        b = t.spread(f"distinct.{system}", "per_second")
        floor = max(250_000.0, 25 * b.median) if b else math.inf
        t.figure(f"distinct keys/s into Redis, one process (baseline: {label})",
                 t.spread("distinct.coalescer", "per_second"), b, fmt=_short,
                 target=">= 250,000 and >= 25x baseline", ok=_at_least(floor),
                 peers="distinct.per_second" if system == "baseline" else "")
    t.figure("Redis commands per distinct touch", t.spread("commands.coalescer", "per_touch"),
             t.spread("commands.baseline", "per_touch"), fmt=lambda v: _fmt(v, digits=4),
             target="<= 0.02", ok=lambda c: c <= 0.02)


def _lag_rows(t: Rows) -> None:
    for name, rate in (("lag1000", 1000), ("lag5000", 5000)):
        t.figure(f"machine noise during the {rate:,}/s lag runs: an idle process's longest "
                 "stall (1 ms sleeps)", t.spread(f"{name}.coalescer_default",
                                                 "machine.max_stall_ms"), None,
                 fmt=lambda v: _fmt(v, " ms", 1))
        for system, label in (("coalescer_default", f"default concurrency {F.DEFAULT_CONCURRENCY}"),
                              ("coalescer", f"concurrency {F.LAG_CONCURRENCY}")):
            for p in ("p50", "p99"):
                gate = p == "p99" and system == "coalescer_default"  # the target: the default
                t.figure(f"start lag {p} at {rate:,} due keys/s, {label}",
                         t.spread(f"{name}.{system}", p), t.spread(f"{name}.baseline", p),
                         fmt=lambda v: _fmt(v, " ms", 1), target="<= 10 ms" if gate else "-",
                         ok=(lambda c: c <= 10) if gate else None,
                         peers=f"{name}.{p}" if system == "coalescer_default" else "")


def _worker_rows(t: Rows) -> None:
    _lag_rows(t)
    for system, conc, target in (
            ("coalescer_default", F.DEFAULT_CONCURRENCY, 10_000),
            ("coalescer", t.sizes.drain_concurrency, 70_000)):
        label = "default concurrency" if system == "coalescer_default" else "concurrency"
        t.rate(f"drain, no-op handler, one node ({label} {conc}), refreshes/s",
               f"drain.{system}", "drain.baseline", target=f">= {target:,}",
               ok=_at_least(target), peers=system == "coalescer_default")
    _processes_rows(t)
    _batch_rows(t)
    t.figure("Redis commands/s of an idle node", t.spread("idle.coalescer", "per_second"),
             t.spread("idle.baseline", "per_second"), fmt=lambda v: _fmt(v, digits=2),
             target="<= 0.5", ok=lambda c: c <= 0.5, peers="idle.per_second")


def _batch_rows(t: Rows) -> None:
    """Batch handlers beside the per-key figures of the same run (the baseline column)."""
    t.figure(f"drain, no-op batch handler (batch {B.BATCH}, default concurrency), keys/s "
             "(beside: per-key handler)", t.spread("batches.coalescer_batch", "per_second"),
             t.spread("batches.coalescer_default", "per_second"), fmt=_short,
             target=">= 100,000", ok=_at_least(100_000))
    t.figure("drain, no-op batch handler: Redis work a key, us (beside: per-key handler)",
             t.spread("batches.coalescer_batch", "redis_us_per_key"),
             t.spread("batches.coalescer_default", "cpu.redis_command_us_per_item"),
             fmt=lambda v: _fmt(v, digits=1), target="<= 8", ok=lambda c: c <= 8)
    per_key = t.spread("stats_app.coalescer_per_key", "per_second")
    floor = 10 * per_key.median if per_key else math.inf
    t.figure(f"stats app after a bulk import ({B.STATS_CUSTOMERS:,} customers, quick: a fifth)"
             ", batch handler keys/s (beside: per-key handler)",
             t.spread("stats_app.coalescer_batch", "per_second"), per_key, fmt=_short,
             target=">= 10x per-key", ok=_at_least(floor))


def _items_rows(t: Rows) -> None:
    """Touches with items beside the plain touches of the same run (the baseline column)."""
    t.figure(f"touches with items into Redis, one process ({t.sizes.items_keys:,} keys x "
             f"{t.sizes.items_per_key} items), items/s (beside: distinct plain keys/s)",
             t.spread("items.coalescer_items", "per_second"),
             t.spread("items.coalescer_distinct", "per_second"), fmt=_short,
             target=">= 100,000", ok=_at_least(100_000))
    t.figure("plain hot-key touch() calls/s, same run as the items (beside: the hot_key "
             "group's, when run)", t.spread("items.coalescer_hot_key", "per_second"),
             t.spread("hot_key.coalescer", "per_second"), fmt=_short,
             target=">= 1,000,000", ok=_at_least(1_000_000))


def _processes_rows(t: Rows) -> None:
    shards = f"{N.PROCESS_SHARDS} shards, concurrency {t.sizes.drain_concurrency}"
    for n in (1, 2):
        t.figure(f"drain, no-op handler, run --processes {n} ({shards}), refreshes/s",
                 t.spread("processes.coalescer", f"processes_{n}.per_second"), None,
                 fmt=_short)
    t.figure("drain: run --processes 2 / --processes 1 (ratio within each run)",
             t.spread("processes.coalescer", "ratio"), None, fmt=lambda v: _fmt(v, "x", 2),
             target=">= 1.6x", ok=lambda c: c >= 1.6)


def _bytes_per_key_row(t: Rows, label: str, group: str) -> None:
    t.figure(label, t.spread(f"{group}.coalescer", "bytes_per_key"),
             t.spread(f"{group}.baseline", "bytes_per_key"), fmt=lambda v: _fmt(v, " B"),
             target="<= 150 B", ok=lambda c: c <= 150)


def _pending_rows(t: Rows) -> None:
    n = f"{t.sizes.million:,}"
    _bytes_per_key_row(t, f"Redis memory per pending key at {n} pending", "million")
    for what, label in (("touch", "touch of new keys"), ("retouch", "touch of pending keys"),
                        ("claim", "claim")):
        spreads = {}
        for system in ("coalescer", "baseline"):
            field = f"{what}_us_per_key_server"
            big, small = t.runs(f"million.{system}"), t.runs(f"million.{system}_small")
            ratios = [b[field] / s[field] for b, s in zip(big, small, strict=False)
                      if b.get(field) is not None and s.get(field)]
            spreads[system] = Spread(ratios) if ratios else None
        t.figure(f"{label}: Redis time per key at {n} / at {t.sizes.small:,} pending",
                 spreads["coalescer"], spreads["baseline"], fmt=lambda v: _fmt(v, "x", 2),
                 target="<= 1.5x", ok=lambda c: c <= 1.5)


def _scheduled_rows(t: Rows) -> None:
    n = f"{t.sizes.million:,}"
    _bytes_per_key_row(t, f"Redis memory per key scheduled up to 30 days ahead, {n} scheduled",
                       "scheduled")
    t.figure(f"start lag p99 of scheduled keys falling due at {SC.SLICE_RATE:,}/s "
             f"({n} more waiting)", t.spread("scheduled.coalescer", "p99"),
             t.spread("scheduled.baseline", "p99"), fmt=lambda v: _fmt(v, " ms", 1),
             target="<= 10 ms", ok=lambda c: c <= 10)


def _failover_rows(t: Rows) -> None:
    t.figure("leader SIGKILL -> standby's first refresh (lease 3 s; baseline lock 1 s)",
             t.spread("failover.coalescer", "takeover_s"),
             t.spread("failover.baseline", "takeover_s"), fmt=lambda v: _fmt(v, " s", 2),
             target="<= 3.5 s", ok=lambda c: c <= 3.5)


def _idle_shards_rows(t: Rows) -> None:
    for n in S.SHARD_COUNTS:
        where = f"idle_shards.coalescer_{n}"
        limit = 50.0 if n > 1 else 0.5
        field = "per_second" if n > 1 else "client_per_second"
        counted = "server-counted" if n > 1 else "sent by clients"
        shards = f"{n:,} shard{'' if n == 1 else 's'}"
        t.figure(f"idle node leading {shards}: Redis commands/s ({counted})",
                 t.spread(where, field), None, fmt=lambda v: _fmt(v, digits=2),
                 target=f"<= {limit:g}", ok=_at_most(limit))
        t.figure(f"idle node leading {shards}: CPU, % of a core",
                 t.spread(where, "cpu_percent"), None, fmt=lambda v: _fmt(v, " %", 1),
                 target="<= 3 %", ok=lambda c: c <= 3.0)
    for n in S.FAILOVER_COUNTS:
        t.figure(f"leader SIGKILL -> the other node leads its shards, {n:,} "
                 f"shard{'' if n == 1 else 's'} (lease {S.LEASE:g} s)",
                 t.spread(f"idle_shards.failover_{n}", "takeover_s"),
                 None, fmt=lambda v: _fmt(v, " s", 2), target=f"<= {S.LEASE + 0.5:g} s",
                 ok=lambda c: c <= S.LEASE + 0.5)
    for n in S.WRITE_COUNTS:
        t.figure(f"distinct keys/s into Redis from one process, {n:,} "
                 f"shard{'' if n == 1 else 's'}",
                 t.spread(f"idle_shards.write_{n}", "write_per_second"), None, fmt=_short)


def _throttle_rows(t: Rows) -> None:
    low, high = T.RATE * 0.9, T.RATE * 1.1
    t.figure(f"throttled rule at rate: {T.RATE}/s over {T.NODES} node processes, starts/s",
             t.spread("throttle.coalescer", "per_second"), None, fmt=lambda v: _fmt(v, digits=1),
             target=f"{T.RATE}/s +-10%", ok=lambda c: low <= c <= high)
    t.figure("throttled rule: off the rate by, % (starts/s over the rate, minus 1)",
             t.spread("throttle.coalescer", "off_percent"), None,
             fmt=lambda v: _fmt(v, " %", 1))
    t.figure("throttled rule: starts/s past the first second (the bucket's burst left out)",
             t.spread("throttle.coalescer", "steady_per_second"), None,
             fmt=lambda v: _fmt(v, digits=1))
    t.lost("lost updates: throttled rule", "throttle.coalescer", "throttle.none", ".",
           peers=False)
    n = f"{t.sizes.bulk_keys:,}"
    for suffix, buffer in (("", T.DEFAULT_BUFFER), ("_small", T.SMALL_BUFFER)):
        for system, label in (("coalescer_touch", "touch (refuses)"),
                              ("coalescer_wait", "touch_wait (waits for room)")):
            waits = system == "coalescer_wait"
            where = f"bulk.{system}{suffix}"
            head = f"bulk import, {n} keys, {T.THREADS} threads, buffer {buffer:,}, {label}"
            t.figure(f"{head}: BackpressureError raised", t.spread(where, "refused"), None,
                     fmt=_fmt, target="0" if waits else "-",
                     ok=(lambda c: c == 0) if waits else None)
            t.figure(f"{head}: keys missing from Redis", t.spread(where, "missing"), None,
                     fmt=_fmt, target="0" if waits else "-",
                     ok=(lambda c: c == 0) if waits else None)
            t.figure(f"{head}: keys/s into Redis", t.spread(where, "per_second"), None,
                     fmt=_short)


def _kafka_rows(t: Rows) -> None:
    t.figure("Kafka -> Redis touches through one node, messages/s (JSON values, 4 "
             "partitions; beside: the seed's consumer, ZADD a batch)",
             t.spread("kafka.coalescer_throughput", "per_second"),
             t.spread("kafka.baseline_throughput", "per_second"), fmt=_short,
             target=">= 50,000", ok=_at_least(50_000))
    t.figure(f"a burst of {t.sizes.million:,} Kafka messages: the node's peak RSS "
             "(beside: the seed's in-memory delay queue)",
             t.spread("kafka.coalescer_burst", "peak_rss_mb"),
             t.spread("kafka.baseline_burst", "peak_rss_mb"), fmt=lambda v: _fmt(v, " MB"),
             target="<= 200 MB", ok=lambda c: c <= 200)


def _outbox_rows(t: Rows) -> None:
    t.figure("outbox on PostgreSQL through one node, touches/s (rows waiting, node started)",
             t.spread("outbox.coalescer_throughput", "per_second"), None, fmt=_short,
             target=">= 20,000", ok=_at_least(20_000))
    t.lost("lost updates: outbox throughput (rows vs keys pending in Redis)",
           "outbox.coalescer_throughput", "outbox.none", ".", peers=False)
    for p in ("p50", "p99"):
        t.figure(f"outbox commit -> Redis {p} at {O.LAG_RATE:,} commits/s, LISTEN/NOTIFY",
                 t.spread("outbox.coalescer_lag", p), None, fmt=lambda v: _fmt(v, " ms", 1),
                 target="<= 50 ms" if p == "p99" else "-",
                 ok=(lambda c: c <= 50) if p == "p99" else None)
    t.lost("lost updates: outbox lag workload", "outbox.coalescer_lag", "outbox.none", ".",
           peers=False)
    ctext, clost = t.lost_text("outbox.coalescer_kills", "outbox")
    btext, _ = t.lost_text("outbox.coalescer_kills", "after_commit")
    t.add(f"writer SIGKILLed right after commit ({O.KILLED_WRITERS} writers a run): touches "
          "lost with the outbox (beside: with touch_after_commit)", ctext, btext,
          target="0", met=None if clost is None else clost == 0)
    t.figure("a touch added to a transaction (one INSERT, SQLAlchemy), us (beside: the "
             "transaction without it)", t.spread("outbox.coalescer_cost", "added_us"),
             t.spread("outbox.coalescer_cost", "plain_us"), fmt=lambda v: _fmt(v, digits=0))
    t.figure("the same into a table without the NOTIFY trigger, us",
             t.spread("outbox.coalescer_cost", "added_quiet_us"), None,
             fmt=lambda v: _fmt(v, digits=0))


def _fleet_rows(t: Rows) -> None:
    where = "fleet.coalescer"
    fleet = f"{FL.NODES} node processes, {FL.SHARDS:,} shards, {FL.MASTERS}-master cluster"
    t.figure(f"fleet ({fleet}): seconds to even shares", t.spread(where, "converge_s"),
             None, fmt=lambda v: _fmt(v, " s", 1), target="<= 10 s", ok=lambda c: c <= 10)
    t.figure(f"fleet ({fleet}), idle: Redis commands/s over the masters (server-counted)",
             t.spread(where, "idle_per_second"), None, fmt=lambda v: _fmt(v, digits=1),
             target="<= 50", ok=lambda c: c <= 50)
    t.figure(f"fleet: node SIGKILL -> its shards led by others (lease {FL.LEASE:g} s)",
             t.spread(where, "takeover_s"), None, fmt=lambda v: _fmt(v, " s", 2),
             target=f"<= {FL.LEASE + 0.5:g} s", ok=lambda c: c <= FL.LEASE + 0.5)
    t.figure(f"fleet: start lag p99 at {FL.RATE:,} due keys/s over the nodes",
             t.spread(where, "lag_p99_ms"), None, fmt=lambda v: _fmt(v, " ms", 1))
    t.lost(f"lost updates: fleet grown from {FL.GROW_FROM} to {FL.NODES} nodes under load",
           where, "fleet.none", "grow_counts", peers=False)
    t.lost(f"lost updates: fleet resharded from {FL.RESHARD_FROM} to {FL.RESHARD_TO:,} "
           "shards under load (a rolling deploy)", where, "fleet.none", "reshard_counts",
           peers=False)
    t.figure(f"fleet: reshard {FL.RESHARD_FROM} -> {FL.RESHARD_TO:,}, seconds from the first "
             "restart to its end", t.spread(where, "reshard_s"), None,
             fmt=lambda v: _fmt(v, " s", 1))


def rows(res: dict[str, Any], sizes: C.Sizes) -> list[dict[str, Any]]:
    """One row per figure: the two values, their ratio, the target and whether it is met."""
    t = Rows(res, sizes)
    for part in (_lost_rows, _write_path_rows, _worker_rows, _pending_rows, _scheduled_rows,
                 _failover_rows,
                 _idle_shards_rows, _throttle_rows, _items_rows, _outbox_rows, _kafka_rows,
                 _fleet_rows, FRows.rows, FS.rows, LE.rows, TL.rows, BO.rows):
        part(t)
    return t.out


# -- which side is the ceiling: CPU per item ----------------------------------------------


@dataclass(frozen=True)
class CpuFigure:
    """One row of the CPU section: a figure's runs and who ran it."""

    label: str
    where: str  # "group.system"
    field: str  # the run's dict holding ``cpu`` and ``per_second`` ("" for the run itself)
    processes: int = 1  # Python processes doing the work
    masters: int = 1  # valkey-server processes


def _cpu_figures(sizes: C.Sizes) -> list[CpuFigure]:
    tuned, default = sizes.drain_concurrency, F.DEFAULT_CONCURRENCY
    cl = f"{N.CLUSTER_MASTERS}-master cluster, {N.CLUSTER_SHARDS} shards"
    return [
        CpuFigure("hot-key touch() call", "hot_key.coalescer", ""),
        CpuFigure("distinct touch, one process", "distinct.coalescer", ""),
        CpuFigure("distinct touch, baseline (1 writer loop)", "distinct.baseline", ""),
        CpuFigure("distinct touch, baseline (64 writers)", "distinct.baseline_64", ""),
        CpuFigure(f"refresh, drain, one node, concurrency {default}",
                  "drain.coalescer_default", ""),
        CpuFigure(f"refresh, drain, one node, concurrency {tuned}", "drain.coalescer", ""),
        CpuFigure(f"refresh, run --processes 1, concurrency {tuned}", "processes.coalescer",
                  "processes_1"),
        CpuFigure(f"refresh, run --processes 2, concurrency {tuned}", "processes.coalescer",
                  "processes_2", processes=2),
        CpuFigure(f"distinct touch, one process, {cl}", "cluster.coalescer", "distinct",
                  masters=N.CLUSTER_MASTERS),
        CpuFigure(f"refresh, run --processes 2, concurrency {default}, {cl}",
                  "cluster.coalescer", "drain_default", processes=N.CLUSTER_PROCESSES,
                  masters=N.CLUSTER_MASTERS),
        CpuFigure(f"refresh, run --processes 2, concurrency {tuned}, {cl}",
                  "cluster.coalescer", "drain", processes=N.CLUSTER_PROCESSES,
                  masters=N.CLUSTER_MASTERS),
    ]


def _med(t: Rows, f: CpuFigure, field: str) -> float | None:
    spread = t.spread(f.where, f"{f.field}.{field}" if f.field else field)
    return spread.median if spread else None


def _ceiling(t: Rows, f: CpuFigure) -> str:
    """From how busy each side kept its cores (medians; per process, per master)."""
    wall = _med(t, f, "cpu.wall_s")
    py, rd = _med(t, f, "cpu.python_cpu_s"), _med(t, f, "cpu.redis_cpu_s")
    if not wall or py is None or rd is None:
        return "n/a"
    cores = os.cpu_count() or 1
    if f.processes + f.masters > cores and (py + rd) / wall / cores >= BUSY:
        return f"all {cores} cores"
    busy = {"Python": py / wall / f.processes, "Redis": rd / wall / f.masters}
    side = max(busy, key=lambda k: busy[k])
    if busy[side] >= BUSY:
        return side
    if sum(busy.values()) >= BUSY:
        return "both, in turn"
    other = (_med(t, f, "cpu.other_cpu_s") or 0.0) / wall
    if other >= OTHER_LOAD:
        return "other load"
    return "neither (waits)"


BUSY = 0.8  # a core this busy (or two sides together, in turn) is the ceiling
OTHER_LOAD = 0.3  # cores busy with other processes: the machine was shared


def _caps(t: Rows, f: CpuFigure) -> str:
    """Items/s the CPU per item allows: Python on its processes, Redis on its masters."""
    py, rd = _med(t, f, "cpu.python_us_per_item"), _med(t, f, "cpu.redis_cpu_us_per_item")
    caps = [_short(n * 1e6 / us) if us else "n/a" for n, us in ((f.processes, py),
                                                                 (f.masters, rd))]
    return " / ".join(caps)


def cpu_rows(res: dict[str, Any], sizes: C.Sizes) -> list[dict[str, Any]]:
    """Per figure: the rate, CPU per item on each side, how busy each side was, the ceiling."""
    t = Rows(res, sizes)
    out = []
    for f in _cpu_figures(sizes):
        def cell(field: str, fmt: Callable[[float], str], f: CpuFigure = f) -> str:
            spread = t.spread(f.where, f"{f.field}.{field}" if f.field else field)
            return spread.text(fmt) if spread else "n/a"
        rate = cell("per_second", _short)
        if rate == "n/a":
            continue
        us = lambda v: _fmt(v, digits=1)  # noqa: E731
        wall, py, rd = (_med(t, f, f"cpu.{x}") for x in ("wall_s", "python_cpu_s", "redis_cpu_s"))
        busy = f"{py / wall:.2f} / {rd / wall:.2f}" if wall and py is not None and rd is not None \
            else "n/a"
        other = _med(t, f, "cpu.other_cpu_s")
        out.append({"figure": f.label, "items/s": rate,
                    "Python µs": cell("cpu.python_us_per_item", us),
                    "Redis CPU µs": cell("cpu.redis_cpu_us_per_item", us),
                    "Redis cmd µs": cell("cpu.redis_command_us_per_item", us),
                    "cores busy Py / Redis": busy,
                    "other load": f"{other / wall:.2f}" if wall and other is not None
                    else "n/a",
                    "caps/s Py / Redis": _caps(t, f), "ceiling": _ceiling(t, f)})
    return out


CPU_COLUMNS = ["figure", "items/s", "Python µs", "Redis CPU µs", "Redis cmd µs",
               "cores busy Py / Redis", "other load", "caps/s Py / Redis", "ceiling"]


# -- a 3-master Redis Cluster ---------------------------------------------------------------


def cluster_rows(res: dict[str, Any], sizes: C.Sizes) -> list[dict[str, Any]]:
    """The cluster figures, beside the one-server figures of the same run (if measured)."""
    t = Rows(res, sizes)
    where = "cluster.coalescer"
    procs = f"run --processes {N.CLUSTER_PROCESSES}"
    specs = [  # the one-server figure beside it: the closest the other groups measure
        ("distinct keys/s into the cluster, one writer process", "distinct.per_second",
         "distinct.coalescer", "per_second"),
        (f"drain, no-op handler, {procs}, default concurrency {F.DEFAULT_CONCURRENCY}, "
         f"refreshes/s (one server: the same, {N.CLUSTER_SHARDS} shards)",
         "drain_default.per_second", where, "drain_default_one_server.per_second"),
        (f"drain, no-op handler, {procs}, default concurrency {F.DEFAULT_CONCURRENCY}, "
         "refreshes/s (one server: one node in process)", "drain_default.per_second",
         "drain.coalescer_default", "per_second"),
        (f"drain, no-op handler, {procs}, concurrency {sizes.drain_concurrency}, refreshes/s "
         f"(one server: {procs}, {N.PROCESS_SHARDS} shards)", "drain.per_second",
         "processes.coalescer", "processes_2.per_second"),
    ]
    out = []
    for label, field, single, single_field in specs:
        c, b = t.spread(where, field), t.spread(single, single_field)
        out.append({"figure": label, "cluster": c.text(_short) if c else "n/a",
                    "one server, same run": b.text(_short) if b else "not run",
                    "ratio": _ratio(c, b)})
    for name, conc in (("drain_default", F.DEFAULT_CONCURRENCY),
                       ("drain", sizes.drain_concurrency)):
        text, _ = t.lost_text(where, f"{name}.g1")
        single = (t.lost_text(where, "drain_default_one_server.g1")[0]
                  if name == "drain_default" else "-")
        out.append({"figure": f"lost updates: cluster drain, concurrency {conc}",
                    "cluster": text, "one server, same run": single, "ratio": "-"})
    return out


CLUSTER_COLUMNS = ["figure", "cluster", "one server, same run", "ratio"]


def table(rs: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    cols = cols or ["figure", "coalescer", "baseline", "ratio", *PEERS,
                    *(f"vs {p}" for p in PEERS), "target", "met"]
    width = {c: max([len(c), *(len(str(r[c])) for r in rs)]) for c in cols}
    line = "| " + " | ".join(c.ljust(width[c]) for c in cols) + " |"
    sep = "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|"
    body = ["| " + " | ".join(str(r[c]).ljust(width[c]) for c in cols) + " |" for r in rs]
    return "\n".join([line, sep, *body])


def _git() -> dict[str, Any]:
    """The commit measured, and whether coalescer/ had uncommitted changes."""
    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True,
                                  text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()
    return {"head": git("rev-parse", "--short", "HEAD"),
            "coalescer_dirty": bool(git("status", "--porcelain", "--", "coalescer"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes (writes no results file)")
    p.add_argument("--only", default="", help=f"comma-separated groups of {', '.join(GROUPS)}")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"fresh runs of each measurement (default {REPEATS})")
    p.add_argument("--json", default=None,
                   help="where to write results (default: bench/results.json, full runs only)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, not {args.repeats}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = C.Sizes.quick() if args.quick else C.Sizes()
    names = [n for n in args.only.split(",") if n] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        p.error(f"unknown group(s): {', '.join(unknown)}")
    results: dict[str, Any] = {}
    load0 = os.getloadavg()
    t0 = time.monotonic()
    print(f"bench: {'quick' if args.quick else 'full'} run of {', '.join(names)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="coalescer-bench-") as tmp:
        for name in names:
            run_in_loop(run_group(name, sizes, Path(tmp), results, args.repeats))
    elapsed = time.monotonic() - t0
    rs = rows(results, sizes)
    if args.only:
        rs = [r for r in rs if r["coalescer"] != "n/a" or r["baseline"] != "n/a"]
    if rs:
        print()
        print(table(rs))
    extra = _print_sections(results, sizes)
    _print_errors(results)
    print(f"\n{'quick' if args.quick else 'full'} run, {args.repeats} runs of each, "
          f"{elapsed:.0f} s, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    doc = {"mode": "quick" if args.quick else "full", "seconds": round(elapsed, 1),
           "load_average_at_start_and_end": [load0, os.getloadavg()],
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "argv": sys.argv[1:], "repeats": args.repeats, "git": _git(),
           "sizes": vars(sizes), "table": rs, **extra, "results": results}
    _write(args, doc)
    return 0


def _print_sections(results: dict[str, Any], sizes: C.Sizes) -> dict[str, Any]:
    """The CPU-per-item and cluster sections, printed where their figures were measured."""
    cpu, cluster = cpu_rows(results, sizes), cluster_rows(results, sizes)
    if cpu:
        print("\nCPU per item: which side is the ceiling (µs per touch or refresh, min / median"
              " / max; Python: the process(es) doing the work; Redis CPU: INFO cpu user + sys;"
              " Redis cmd: INFO commandstats usec of the scripts; Redis summed over the masters;"
              " cores busy and other load (cores used by other processes): medians; caps: the"
              " rate each side's CPU allows)")
        print(table(cpu, CPU_COLUMNS))
    if "cluster" in results:
        print(f"\nRedis Cluster: {N.CLUSTER_MASTERS} masters (local valkey-server processes), "
              f"{N.CLUSTER_SHARDS} shards, {N.CLUSTER_PROCESSES} node processes")
        print(table(cluster, CLUSTER_COLUMNS))
    return {"cpu_table": cpu, "cluster_table": cluster if "cluster" in results else []}


def _print_errors(results: dict[str, Any]) -> None:
    for name, systems in results.items():
        for system, result in systems.items():
            for i, run in enumerate(result["runs"]):
                if "error" in run:
                    print(f"ERROR {name}/{system} run {i + 1}: {run['error']}")
                if "skipped" in run:
                    print(f"SKIPPED {name}/{system}: {run['skipped']}")


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """Write results: the tracked bench/results.json holds full runs of every group only."""
    path = args.json or (None if args.quick or args.only else HERE / "results.json")
    if path is None:
        print("wrote no results file (a quick or partial run; --json PATH writes one)")
        return
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
