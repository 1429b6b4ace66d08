"""The ``fair_shards`` group: how fair a ``fair:`` rule's order is across shards.

Each shard keeps its own virtual time (store/lua/_fair.lua), so the order is exact within
a shard and the whole is only as fair as the shards' orders added up. One node in this
process, concurrency 16 (a claim call takes up to 32 keys: 16 to run, 16 to queue), a
no-op async handler that appends each start's key to ``STARTED`` (start order: the order
the node calls the handler, no clock), rule ``t:{org}:{id}`` with ``shards: 1``, ``4``
and ``16`` side by side in the same run. The node leads every shard before any key is
written, and the keys are written with ``at`` (due ``LEAD`` s ahead), so every shard has
its due keys from the first claim on:

- ``weighted_N``: three tenants at weights 5:3:2, ``claims`` due keys each, interleaved
  (every tenant backlogged in every shard throughout), due over ``SPREAD`` s: each
  tenant's count of the first ``claims`` starts against its weight's.
- ``equal_N``: four tenants at equal weight, the same.

  Each reports the largest share error over the first ``claims`` starts (relative, %),
  the largest error over any ``WINDOW`` consecutive starts (in claims of the window, and
  relative to the tenant's share of it), the largest lead or lag of a tenant on its
  share at any point of the start order (claims: the figure "one claim batch per shard"
  bounds), and how many of the first ``claims`` starts each shard made.
- ``quiet_N``: tenant ``a`` has ``claims`` keys due at one instant, a quiet tenant one
  key (in the last shard) due at the same instant, written after them (due order, which
  breaks ties by key, would claim it last): the starts before the quiet key's, and each
  shard's share of them.
- ``cap_N`` and ``cap_cluster_N``: ``max_running: CAP`` with ``CAP_TENANTS`` tenants over
  ``N`` shards, handlers asleep up to ``CAP_WORK`` s, on one server and on a local
  3-master Redis Cluster: the most runs of one tenant at once, counted in the handler
  (a run ends there before the node acks it, so the count is never above the server's).
  On one server the runs are counted in one place for every shard; on a Cluster each
  shard counts its own (the script can only touch its own slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coalescer import Coalescer, Config
from coalescer.store.keys import KeySpace

from . import common as C
from . import fairness as FR
from .valkey import Server, start_cluster

NS = "fairshards"
WEIGHTED = {"x": 5, "y": 3, "z": 2}
EQUAL = {"e0": 1, "e1": 1, "e2": 1, "e3": 1}
SHARD_COUNTS = (1, 4, 16)
CAP_SHARDS = 16
CONCURRENCY = 16
BATCH = 2 * CONCURRENCY  # keys a claim call takes at most: the running and queued slots
WINDOW = 100  # consecutive starts of a short-horizon window
CAP = 2
CAP_TENANTS = 4
CAP_WORK = 0.002  # seconds a capped run sleeps, at most
CLUSTER_MASTERS = 3
WAIT = 120.0
LEAD = 1.0  # seconds from the write to the keys' due time, besides the write's own
WRITE_RATE = 20_000  # keys/s a loaded machine writes at least
SPREAD = 0.5  # seconds the backlog's due times spread over
CHUNKS = 100  # parts of the backlog, each due at its own time


@dataclass
class ShardSizes:
    """How big each figure is (full and ``quick``; the test: ``tiny``)."""

    claims: int = 10_000
    cap_claims: int = 4_000

    @classmethod
    def quick(cls) -> ShardSizes:
        return cls(claims=5_000, cap_claims=2_000)

    @classmethod
    def tiny(cls) -> ShardSizes:
        return cls(claims=600, cap_claims=200)


def sizes_of(sizes: C.Sizes) -> ShardSizes:
    """The fair shards sizes of a run (see common.module_sizes)."""
    return C.module_sizes(sizes, "fair_shards", ShardSizes)


# -- what the handlers record ----------------------------------------------------------

STARTED: list[str] = []  # each start's key, in the order the node called the handler
RUNNING: dict[str, int] = defaultdict(int)
CAPPED = {"over": 0, "most": 0}


async def started(claim: Any) -> None:
    STARTED.append(claim.key)


async def capped(claim: Any) -> None:
    """A run that counts its tenant's runs at once while it sleeps."""
    org = claim.params["org"]
    RUNNING[org] += 1
    STARTED.append(claim.key)
    CAPPED["most"] = max(CAPPED["most"], RUNNING[org])
    if RUNNING[org] > CAP:
        CAPPED["over"] += 1
    try:
        await asyncio.sleep(random.uniform(0, CAP_WORK))
    finally:
        RUNNING[org] -= 1


def reset() -> None:
    STARTED.clear()
    RUNNING.clear()
    CAPPED.update(over=0, most=0)


# -- the figures ---------------------------------------------------------------------------


def ideal(weights: dict[str, int]) -> dict[str, float]:
    total = sum(weights.values())
    return {org: w / total for org, w in weights.items()}


def share_errors(order: list[str], weights: dict[str, int]) -> dict[str, Any]:
    """Each tenant's count of ``order`` against its weight's: the largest relative error
    (%) over the whole, and the largest lead or lag (claims) at any point of it."""
    want = ideal(weights)
    n = len(order)
    counts = {org: 0 for org in weights}
    most = 0.0
    for i, org in enumerate(order, 1):
        counts[org] = counts.get(org, 0) + 1
        most = max(most, *(abs(counts[g] - i * want[g]) for g in weights))
    rel = {org: (counts[org] / max(1, n) / want[org] - 1) * 100 for org in weights}
    return {"claims": n, "counts": counts, "error_percent": rel,
            "max_error_percent": max(abs(v) for v in rel.values()),
            "max_drift_claims": most}


def window_errors(order: list[str], weights: dict[str, int],
                  window: int = WINDOW) -> dict[str, Any]:
    """Over every ``window`` consecutive starts of ``order`` (sliding): the largest error
    of a tenant's count against its share of the window, in claims and relative (%),
    and the median and p99 over the windows of each window's largest (claims)."""
    want = ideal(weights)
    if len(order) < window:
        return {"windows": 0}
    prefix = {org: [0] for org in weights}
    for org in order:
        for g, sums in prefix.items():
            sums.append(sums[-1] + (g == org))
    worst: list[float] = []
    worst_rel = 0.0
    for start in range(len(order) - window + 1):
        errs = {g: abs(prefix[g][start + window] - prefix[g][start] - window * want[g])
                for g in weights}
        worst.append(max(errs.values()))
        worst_rel = max(worst_rel, *(e / (window * want[g]) * 100 for g, e in errs.items()))
    ranked = sorted(worst)
    return {"windows": len(worst), "window": window,
            "window_max_claims": ranked[-1],
            "window_p50_claims": ranked[len(ranked) // 2],
            "window_p99_claims": ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))],
            "window_max_error_percent": worst_rel}


# -- rules and the runs ------------------------------------------------------------------


def rules(shards: int, fair: str, handler: str) -> str:
    text = FR.tenant_rules(fair, handler=handler, concurrency=CONCURRENCY, namespace=NS)
    return text.replace("shards: 1\n", f"shards: {shards}\n")


@contextlib.asynccontextmanager
async def node(url: str, text: str, *, worker: bool) -> Any:
    config = Config.from_string(text, source="<bench>")
    async with Coalescer(config, redis_url=url, worker=worker, node_id="shards-bench") as c:
        yield c


def _org(key: str) -> str:
    return key.split(":")[1]


def per_shard(keys: list[str], shards: int) -> list[int]:
    """How many of ``keys`` each shard holds."""
    space, counts = KeySpace(NS, shards), [0] * shards
    for key in keys:
        counts[space.shard_of(key)] += 1
    return counts


async def _write_ahead(c: Coalescer, keys: list[str], spread: float,
                       at: float | None = None) -> float:
    """``keys`` written due from ``at`` (epoch s; default ``LEAD`` s plus the write's own
    time ahead) over ``spread`` s, in ``CHUNKS`` equal parts in their order; the latest
    due time."""
    if at is None:
        sec, usec = await c.redis.time()
        at = int(sec) + int(usec) / 1e6 + LEAD + len(keys) / WRITE_RATE
    size = max(1, -(-len(keys) // CHUNKS))
    for i in range(0, len(keys), size):
        await c.touch_many_wait(keys[i:i + size], timeout=None,
                                at=at + spread * i / max(1, len(keys)))
    await c.flush()
    return at + spread


async def _work(url: str, text: str, keys: list[str], n: int, *, spread: float = SPREAD,
                then: list[str] | None = None) -> dict[str, Any]:
    """One node leads every shard, writes ``keys`` (see ``_write_ahead``) and ``then``
    due with the last of them, and works them until ``n`` starts were recorded."""
    reset()
    space = KeySpace(NS, Config.from_string(text, source="<bench>").shards)
    async with node(url, text, worker=True) as c:
        leads = await C.wait_led(c.redis, space, 1)
        t0 = time.monotonic()
        last = await _write_ahead(c, keys, spread)
        if then:
            await _write_ahead(c, then, 0.0, last)
        written_s = time.monotonic() - t0
        sec, usec = await c.redis.time()
        late = int(sec) + int(usec) / 1e6 > last - spread
        await C.wait_for(lambda: len(STARTED) >= n, WAIT, f"{n} starts")
        seconds = time.monotonic() - t0
    return {"shards": space.shards, "leads": leads, "written_s": written_s,
            "written_late": late, "seconds": seconds}


async def shares(server: Server, sizes: C.Sizes, tenants: str, shards: int) -> dict[str, Any]:
    """The shares of the first ``claims`` starts among backlogged tenants (``tenants``:
    "weighted" 5:3:2 or "equal") over ``shards`` shards."""
    weights = WEIGHTED if tenants == "weighted" else EQUAL
    n = sizes_of(sizes).claims
    text = rules(shards, FR.fair_block(weights=weights if tenants == "weighted" else None),
                 "bench.fairness_shards:started")
    if why := FR.fair_refused(text):
        return {"skipped": why}
    keys = [FR.tkey(org, i) for i in range(n) for org in weights]
    run = await _work(server.url, text, keys, n)
    first = STARTED[:n]
    return {"tenants": tenants, "weights": weights, **run,
            "batch_bound_claims": shards * BATCH,
            "starts_per_shard": per_shard(first, shards),
            **share_errors([_org(k) for k in first], weights),
            **window_errors([_org(k) for k in first], weights), **FR.load_note()}


async def quiet(server: Server, sizes: C.Sizes, shards: int) -> dict[str, Any]:
    """Tenant ``a``'s ``claims`` keys due at one instant, then one key of a quiet tenant
    (in the last shard) due at the same instant: how many starts came before its."""
    n = sizes_of(sizes).claims
    text = rules(shards, FR.fair_block(), "bench.fairness_shards:started")
    if why := FR.fair_refused(text):
        return {"skipped": why}
    space = KeySpace(NS, shards)
    key = next(k for k in (FR.tkey("q", i) for i in range(10_000))
               if space.shard_of(k) == shards - 1)
    run = await _work(server.url, text, [FR.tkey("a", i) for i in range(n)], n + 1,
                      spread=0.0, then=[key])
    place = STARTED.index(key)
    return {**run, "keys": n, "quiet_key": key, "starts_before": place,
            "batch_bound_claims": shards * BATCH,
            "starts_per_shard_before": per_shard(STARTED[:place], shards), **FR.load_note()}


async def cap(server: Server, sizes: C.Sizes, tmp: Path, shards: int,
              cluster: bool) -> dict[str, Any]:
    """``max_running: CAP`` over ``shards`` shards, on ``server`` or on a fresh local
    Redis Cluster: the most runs of one tenant at once."""
    text = rules(shards, FR.fair_block(max_running=CAP), "bench.fairness_shards:capped")
    if why := FR.fair_refused(text):
        return {"skipped": why}
    n = sizes_of(sizes).cap_claims
    keys = [FR.tkey(f"c{j}", i) for i in range(n // CAP_TENANTS) for j in range(CAP_TENANTS)]
    if not cluster:
        return await _capped_run(server.url, text, keys)
    folder = tmp / f"fair-shards-cluster-{time.time_ns()}"
    with start_cluster(folder, CLUSTER_MASTERS) as c:
        return {**await _capped_run(c.url, text, keys), "masters": CLUSTER_MASTERS}


async def _capped_run(url: str, text: str, keys: list[str]) -> dict[str, Any]:
    run = await _work(url, text, keys, len(keys))
    return {**run, "cap": CAP, "tenants": CAP_TENANTS, "claims": len(STARTED),
            "over_cap_starts": CAPPED["over"], "max_running_seen": CAPPED["most"],
            **FR.load_note()}


# -- the table's rows (``bench.run.Rows``) ---------------------------------------------------


def _claims(v: float) -> str:
    return f"{v:,.1f}"


def _pct(v: float) -> str:
    return f"{v:.1f} %"


def rows(t: Any) -> None:
    n = sizes_of(t.sizes).claims
    for tenants, shape in (("weighted", "weights 5:3:2"), ("equal", "4 equal tenants")):
        for shards in SHARD_COUNTS[1:]:
            _share_rows(t, tenants, f"{shape}, all backlogged, shards: {shards}", shards, n)
    for shards in SHARD_COUNTS[1:]:
        bound = shards * BATCH
        t.figure(f"tenant a's {n:,} keys due at once over {shards} shards, a quiet tenant's "
                 "key due with them in the last shard: starts before it (beside: shards: 1)",
                 t.spread(f"fair_shards.quiet_{shards}", "starts_before"),
                 t.spread("fair_shards.quiet_1", "starts_before"), fmt=_claims,
                 target=f"<= {bound} (one claim batch a shard)", ok=lambda c, b=bound: c <= b)
    for system, where in (("cap", "one server"), ("cap_cluster", "a 3-master Cluster")):
        t.figure(f"max_running: {CAP}, shards: {CAP_SHARDS}, {where}: the most runs of a "
                 "tenant at once", t.spread(f"fair_shards.{system}_{CAP_SHARDS}",
                                             "max_running_seen"), None,
                 fmt=lambda v: f"{v:g}",
                 target=f"<= {CAP}" if system == "cap" else "-",
                 ok=(lambda c: c <= CAP) if system == "cap" else None)


def _share_rows(t: Any, tenants: str, head: str, shards: int, n: int) -> None:
    where, base = f"fair_shards.{tenants}_{shards}", f"fair_shards.{tenants}_1"
    bound = shards * BATCH
    t.figure(f"{head}: the largest share error over the first {n:,} claims (beside: "
             "shards: 1)", t.spread(where, "max_error_percent"),
             t.spread(base, "max_error_percent"), fmt=_pct, target="<= 5 %",
             ok=lambda c: c <= 5)
    t.figure(f"{head}: a tenant's largest lead or lag on its share at any point, claims "
             "(beside: shards: 1)", t.spread(where, "max_drift_claims"),
             t.spread(base, "max_drift_claims"), fmt=_claims,
             target=f"<= {bound} (one claim batch a shard)", ok=lambda c: c <= bound)
    t.figure(f"{head}: the largest error in any {WINDOW} consecutive claims, claims of "
             f"{WINDOW} (beside: shards: 1)", t.spread(where, "window_max_claims"),
             t.spread(base, "window_max_claims"), fmt=_claims)
