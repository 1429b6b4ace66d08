"""Run every SPEC §6 figure for coalescer and the baseline design, side by side.

    .venv/bin/python -m bench.run [--quick] [--only NAME,...] [--json PATH]

Starts its own valkey-server processes (a fresh one per measurement, on
127.0.0.1), prints ``figure | coalescer | baseline | ratio | target | met`` and
writes bench/results.json. ``ratio`` is coalescer / baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import figures as F
from .valkey import Server

HERE = Path(__file__).resolve().parent

Measure = Callable[..., Awaitable[dict[str, Any]]]

# name -> (coalescer measurement, baseline measurement, extra positional args)
GROUPS: dict[str, list[tuple[str, Measure, tuple[Any, ...]]]] = {
    "burst": [("coalescer", F.burst_coalescer, ()), ("baseline", F.burst_baseline, ()),
              ("baseline_sliding", F.burst_baseline, (True,))],
    "churn": [("coalescer", F.churn_coalescer, ()), ("baseline", F.churn_baseline, ())],
    "hot_key": [("coalescer", F.hot_key_coalescer, ()), ("baseline", F.hot_key_baseline, ())],
    "distinct": [("coalescer", F.distinct_coalescer, ()), ("baseline", F.distinct_baseline, (1,)),
                 ("baseline_64", F.distinct_baseline, (64,))],
    "commands": [("coalescer", F.commands_coalescer, ()), ("baseline", F.commands_baseline, ())],
    "lag200": [("coalescer", F.lag_coalescer, (200,)), ("baseline", F.lag_baseline, (200,))],
    "lag1000": [("coalescer", F.lag_coalescer, (1000,)), ("baseline", F.lag_baseline, (1000,))],
    "drain": [("coalescer", F.drain_coalescer, ()), ("baseline", F.drain_baseline, ())],
    "idle": [("coalescer", F.idle_coalescer, ()), ("baseline", F.idle_baseline, ())],
    "million": [("coalescer", F.pending_coalescer, ("N",)),
                ("coalescer_small", F.pending_coalescer, ("SMALL",)),
                ("baseline", F.pending_baseline, ("N",)),
                ("baseline_small", F.pending_baseline, ("SMALL",))],
    "failover": [("coalescer", F.failover_coalescer, ("TMP",)),
                 ("baseline", F.failover_baseline, ("TMP",))],
}


REPEATS = {"hot_key": 3, "distinct": 3, "drain": 3}  # full run: median of 3 fresh runs
MEASURE_TIMEOUT = 150.0  # seconds: no measurement takes a tenth of this when all is well


async def run_group(name: str, sizes: F.Sizes, tmp: Path, results: dict[str, Any],
                    quick: bool) -> None:
    out = results.setdefault(name, {})
    repeats = 1 if quick else REPEATS.get(name, 1)
    for system, measure, extra in GROUPS[name]:
        args = [sizes.million if a == "N" else sizes.small if a == "SMALL"
                else tmp if a == "TMP" else a for a in extra]
        t0 = time.monotonic()
        print(f"  {name}/{system} ...", end="", flush=True)
        runs = []
        for i in range(repeats):
            try:
                with Server(tmp, f"{name}-{system}-{i}") as server:
                    runs.append(await _bounded(measure(server, sizes, *args), name, system))
            except Exception as exc:  # one broken figure must not hide the others
                logging.exception("%s/%s failed", name, system)
                runs.append({"error": f"{type(exc).__name__}: {exc}"})
        out[system] = _median_run(runs)
        print(f" {time.monotonic() - t0:.1f}s", flush=True)


async def _bounded(coro: Awaitable[dict[str, Any]], name: str,
                   system: str) -> dict[str, Any]:
    """Run one measurement for at most MEASURE_TIMEOUT; a stuck one is reported, not waited on."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait([task], timeout=MEASURE_TIMEOUT)
    if task in done:
        return task.result()
    print(f"\n{name}/{system} still running after {MEASURE_TIMEOUT:g}s; its tasks:",
          file=sys.stderr)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            t.print_stack(limit=8, file=sys.stderr)
    task.cancel()
    await asyncio.wait([task], timeout=10)
    raise TimeoutError(f"{name}/{system} took over {MEASURE_TIMEOUT:g}s")


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


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median per_second (all runs' rates kept under ``runs_per_second``)."""
    if len(runs) == 1:
        return runs[0]
    good = [r for r in runs if "per_second" in r]
    if not good:
        return runs[0]
    good.sort(key=lambda r: r["per_second"])
    chosen = dict(good[len(good) // 2])
    chosen["runs_per_second"] = [r["per_second"] for r in good]
    return chosen


# -- the table ---------------------------------------------------------------------------


def _get(d: dict[str, Any], path: str) -> Any:
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


def _lost(g: dict[str, Any] | None) -> str:
    if not g or "lost" not in g:
        return "n/a"
    text = f"{g['lost']} of {g['touches']}"
    if g.get("late"):
        text += f" (+{g['late']} late)"
    return text


def _lag(d: dict[str, Any] | None, p: str) -> tuple[str, float | None]:
    if not d or p not in d:
        return "n/a", None
    v = d[p]
    return (">=" if d.get(f"{p}_lower_bound") else "") + _fmt(v, " ms", 1), v


def _rng(d: dict[str, Any] | None) -> str:
    """A rate, with the range of the repeated runs when there were several."""
    if not d or "per_second" not in d:
        return "n/a"
    text = _fmt(d["per_second"])
    runs = d.get("runs_per_second")
    if runs and len(runs) > 1:
        text += f" ({_short(min(runs))}-{_short(max(runs))})"
    return text


def _short(v: float) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def _ratio(c: float | None, b: float | None) -> str:
    if c is None or b is None or b == 0:
        return "-"
    return f"{c / b:,.3g}x"


class Rows:
    """The table being built: one row per figure."""

    def __init__(self, res: dict[str, Any], sizes: F.Sizes) -> None:
        self.res = res
        self.sizes = sizes
        self.out: list[dict[str, Any]] = []

    def get(self, path: str) -> Any:
        return _get(self.res, path)

    def add(self, figure: str, c: str, b: str, *, ratio: str = "-", target: str = "-",
            met: bool | None = None) -> None:
        self.out.append({"figure": figure, "coalescer": c, "baseline": b, "ratio": ratio,
                         "target": target,
                         "met": "n/a" if met is None else ("yes" if met else "NO")})

    def lost(self, figure: str, cpath: str, bpath: str) -> None:
        cg, bg = self.get(cpath), self.get(bpath)
        met = None if not cg or "lost" not in cg else cg["lost"] == 0
        self.add(figure, _lost(cg), _lost(bg), target="0", met=met)

    def rate(self, figure: str, group: str, base: str, target: str,
             ok: Callable[..., bool]) -> None:
        c, b = self.get(f"{group}.coalescer.per_second"), self.get(f"{group}.{base}.per_second")
        self.add(figure, _rng(self.get(f"{group}.coalescer")), _rng(self.get(f"{group}.{base}")),
                 ratio=_ratio(c, b), target=target,
                 met=None if c is None or b is None else ok(c, b))


def _lost_rows(t: Rows) -> None:
    t.lost(f"lost updates: {F.BURST_TOUCHES}-touch {F.BURST_SECONDS:g} s burst",
           "burst.coalescer", "burst.baseline")
    t.lost("lost updates: same burst, baseline with sliding dedup",
           "burst.coalescer", "burst.baseline_sliding")
    t.lost("lost updates: churn (200 keys, touched while refreshing)",
           "churn.coalescer", "churn.baseline")
    for name in ("lag200", "lag1000", "drain", "failover"):
        t.lost(f"lost updates: {name} workload", f"{name}.coalescer.g1", f"{name}.baseline.g1")


def _write_path_rows(t: Rows) -> None:
    t.rate("hot-key touch() calls/s, one process", "hot_key", "baseline", ">= 1,000,000",
           lambda c, b: c >= 1_000_000)
    for system, label in (("baseline", "1 writer loop, as coalescer's"),
                          ("baseline_64", "64 concurrent writers")):
        t.rate(f"distinct keys/s into Redis, one process (baseline: {label})", "distinct",
               system, ">= 100,000 and >= 18x baseline",
               lambda c, b: c >= 100_000 and c >= 18 * b)
    c, b = t.get("commands.coalescer.per_touch"), t.get("commands.baseline.per_touch")
    t.add("Redis commands per distinct touch", _fmt(c, digits=4), _fmt(b, digits=3),
          ratio=_ratio(c, b), target="<= 0.02", met=None if c is None else c <= 0.02)


def _worker_rows(t: Rows) -> None:
    for name, rate in (("lag200", 200), ("lag1000", 1000)):
        for p in ("p50", "p99"):
            cs, cv = _lag(t.get(f"{name}.coalescer"), p)
            bs, bv = _lag(t.get(f"{name}.baseline"), p)
            last = name == "lag1000" and p == "p99"
            t.add(f"start lag {p} at ~{rate} due keys/s", cs, bs, ratio=_ratio(cv, bv),
                  target="<= 10 ms" if last else "-",
                  met=(None if cv is None else cv <= 10) if last else None)
    t.rate(f"drain, no-op handler, one node ({t.sizes.drain_concurrency} concurrency), "
           "refreshes/s", "drain", "baseline", ">= 20,000", lambda c, b: c >= 20_000)
    c, b = t.get("idle.coalescer.per_second"), t.get("idle.baseline.per_second")
    t.add("Redis commands/s of an idle node", _fmt(c, digits=2), _fmt(b, digits=1),
          ratio=_ratio(c, b), target="<= 1", met=None if c is None else c <= 1.0)


def _pending_rows(t: Rows) -> None:
    n = f"{t.sizes.million:,}"
    c, b = t.get("million.coalescer.bytes_per_key"), t.get("million.baseline.bytes_per_key")
    t.add(f"Redis memory per pending key at {n} pending", _fmt(c, " B"), _fmt(b, " B"),
          ratio=_ratio(c, b), target="<= 200 B", met=None if c is None else c <= 200)
    for what, label in (("touch", "touch of new keys"), ("retouch", "touch of pending keys"),
                        ("claim", "claim")):
        ratios = {}
        for system in ("coalescer", "baseline"):
            big = t.get(f"million.{system}.{what}_us_per_key_server")
            small = t.get(f"million.{system}_small.{what}_us_per_key_server")
            ratios[system] = None if big is None or not small else big / small
        c, b = ratios["coalescer"], ratios["baseline"]
        t.add(f"{label}: Redis time per key at {n} / at {t.sizes.small:,} pending",
              _fmt(c, "x", 2), _fmt(b, "x", 2), target="<= 2x",
              met=None if c is None else c <= 2.0)


def _failover_rows(t: Rows) -> None:
    c, b = t.get("failover.coalescer.takeover_s"), t.get("failover.baseline.takeover_s")
    t.add("leader SIGKILL -> standby's first refresh (lease 3 s; baseline lock 1 s)",
          _fmt(c, " s", 2), _fmt(b, " s", 2), ratio=_ratio(c, b), target="<= 3.5 s",
          met=None if c is None else c <= 3.5)


def rows(res: dict[str, Any], sizes: F.Sizes) -> list[dict[str, Any]]:
    """One row per figure: the two values, their ratio, the target and whether it is met."""
    t = Rows(res, sizes)
    for part in (_lost_rows, _write_path_rows, _worker_rows, _pending_rows, _failover_rows):
        part(t)
    return t.out


def table(rs: list[dict[str, Any]]) -> str:
    cols = ["figure", "coalescer", "baseline", "ratio", "target", "met"]
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
    p.add_argument("--quick", action="store_true", help="smaller sizes: the run takes < 2 min")
    p.add_argument("--only", default="", help=f"comma-separated groups of {', '.join(GROUPS)}")
    p.add_argument("--json", default=str(HERE / "results.json"), help="where to write results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = F.Sizes.quick() if args.quick else F.Sizes()
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
            run_in_loop(run_group(name, sizes, Path(tmp), results, args.quick))
    elapsed = time.monotonic() - t0
    rs = rows(results, sizes)
    if args.only:
        rs = [r for r in rs if r["coalescer"] != "n/a" or r["baseline"] != "n/a"]
    text = table(rs)
    print()
    print(text)
    for name, systems in results.items():
        for system, result in systems.items():
            if "error" in result:
                print(f"ERROR {name}/{system}: {result['error']}")
    print(f"\n{'quick' if args.quick else 'full'} run, {elapsed:.0f} s, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    doc = {"mode": "quick" if args.quick else "full", "seconds": round(elapsed, 1),
           "load_average_at_start_and_end": [load0, os.getloadavg()],
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "argv": sys.argv[1:], "git": _git(), "sizes": vars(sizes), "table": rs,
           "results": results}
    Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
