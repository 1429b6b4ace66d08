"""Fairness between tenants (``fair:`` on a rule) and between rules, each figure measured
with ``fair`` off and on in the same run (the table's "baseline" column is ``fair`` off).

One node in this process at the default concurrency (16), a no-op async handler that
records each start (``started``: per tenant, the start time and its lag behind the key's
due time), rule ``t:{org}:{id}`` with a 100 ms window:

- ``skew``: tenant ``a`` touches ``fair_import`` keys at once (``touch_many_wait`` from
  a process of its own, as an app's import would) while tenant ``b`` touches a new key
  every 0.25 s (from before the import until it has drained): ``b``'s start lag p50/p99,
  and ``a``'s drain (its keys over the time from its first start to its last).
- ``skew_work``: the same with ``sizes.fair_import_work`` keys and a handler that waits
  ``WORK_MS`` after recording its start (a query, say): what ``fair`` costs an import
  when the node's slots, not Redis, bound the drain.
- ``balanced``: ``BALANCED_TENANTS`` tenants touch ``sizes.fair_balanced`` keys each,
  interleaved, at once: each tenant's lag p50/p99 and the drain rate.
- ``weights``: three tenants at weights 5:3:2, each with ``sizes.fair_weights`` due keys
  (all backlogged throughout): each tenant's share of the first ``sizes.fair_weights``
  starts.
- ``herd``: ``herd`` keys of rule ``herd`` scheduled (``at``, from a process of its own)
  for the same second while rule ``other`` is touched every 10 ms: ``other``'s start lag
  p50/p99 while the herd drains (no ``fair``: rules are apart by design; the "baseline"
  column is ``other`` alone, the same node and rate with no herd).
- ``memory``: Redis memory per pending key (``memory_keys`` keys over 100 tenants)
  scheduled an hour ahead (beyond the queues' look-ahead) and due within the window (in
  their tenant's queue), and per tenant (``fair_groups`` tenants of one key each),
  ``fair`` on against off.

The ``max_running`` figure runs over node processes: ``bench/fairness_cap.py``.

A ``fair`` measurement reports ``skipped`` where the rules do not take ``fair:`` (this
code before it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from coalescer import Coalescer, Config
from coalescer.errors import ConfigError
from coalescer.store.fair_args import fair_rules
from coalescer.store.keys import KeySpace
from coalescer.store.scripts import Scripts

from . import common as C
from .figures import stall_probe
from .valkey import Server, used_memory

NS = "fairbench"
SHARD = KeySpace(NS, 1).shard(0)
RULE = "t"
WINDOW = "100ms"
B_EVERY = 0.25  # seconds between the quiet tenant's touches
WORK_MS = 2.0  # what the handler of the skew_work figure waits after its start
BALANCED_TENANTS = 4
WEIGHTS = {"x": 5, "y": 3, "z": 2}
OTHER_EVERY = 0.01  # seconds between touches of the other rule during a herd
HERD_LEAD = 2.0  # seconds from the end of scheduling the herd to its due second
IMPORT_START = 3.0  # seconds an import process may take to start on a loaded machine
SCHEDULE_RATE = 20_000  # keys/s a loaded machine schedules at least (measured: 26,000)
MEMORY_TENANTS = 100
DRAIN_TIMEOUT = 120.0
HERD_DRAIN_TIMEOUT = 300.0  # a million keys at a loaded machine's few thousand a second


@dataclass
class FairSizes:
    """How big each fairness figure is (full and ``quick``; the test: ``tiny``)."""

    fair_import: int = 200_000
    fair_import_work: int = 60_000
    fair_balanced: int = 25_000
    fair_weights: int = 10_000
    herd: int = 1_000_000
    memory_keys: int = 1_000_000
    fair_groups: int = 10_000
    cap_claims: int = 100_000
    herd_lead: float = HERD_LEAD  # seconds from scheduling the herd to its due second

    @classmethod
    def quick(cls) -> FairSizes:
        return cls(fair_import=40_000, fair_import_work=20_000, fair_balanced=5_000,
                   fair_weights=5_000, herd=200_000, memory_keys=200_000, fair_groups=5_000,
                   cap_claims=10_000)

    @classmethod
    def tiny(cls) -> FairSizes:
        return cls(fair_import=600, fair_import_work=300, fair_balanced=100, fair_weights=300,
                   herd=2_000, memory_keys=2_000, fair_groups=200, cap_claims=300,
                   herd_lead=0.5)


def sizes_of(sizes: C.Sizes) -> FairSizes:
    """The fair sizes of a run (see common.module_sizes)."""
    return C.module_sizes(sizes, "fair", FairSizes)


# -- what the handler records ----------------------------------------------------------


class Starts:
    """Refresh starts per group (a tenant, or a rule), on this host's clock."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, offset_ms: float = 0.0) -> None:
        self.offset_ms = offset_ms
        self.times: dict[str, list[float]] = defaultdict(list)
        self.lags_ms: dict[str, list[float]] = defaultdict(list)
        self.count = 0

    def record(self, group: str, due_ms: float) -> None:
        now = time.time()
        self.times[group].append(now)
        self.lags_ms[group].append(now * 1000.0 - (due_ms - self.offset_ms))
        self.count += 1

    def seen(self, group: str) -> int:
        return len(self.times.get(group, ()))


STARTS = Starts()


async def started(claim: Any) -> None:
    """The no-op handler: one start recorded under the key's tenant (else its rule)."""
    STARTS.record(claim.params.get("org") or claim.rule, claim.due_ms)


async def started_then_work(claim: Any) -> None:
    """A handler that records its start, then waits ``WORK_MS`` (a query)."""
    await started(claim)
    await asyncio.sleep(WORK_MS / 1000)


# -- rules ---------------------------------------------------------------------------------


def fair_block(*, weights: dict[str, int] | None = None, max_running: int | None = None) -> str:
    """The rule's ``fair:`` line: groups by the tenant capture."""
    parts = ['by: "{org}"']
    if weights:
        parts.append("weights: {" + ", ".join(f"{k}: {v}" for k, v in weights.items()) + "}")
    if max_running is not None:
        parts.append(f"max_running: {max_running}")
    return "    fair: {" + ", ".join(parts) + "}\n"


def tenant_rules(fair: str = "", *, handler: str = "bench.fairness:started",
                 concurrency: int = 16, namespace: str = NS) -> str:
    return f"""\
namespace: {namespace}
shards: 1
defaults:
  absorb: 20ms
  concurrency: {concurrency}
  timeout: 30s
rules:
  - name: {RULE}
    match: "t:{{org}}:{{id}}"
    window: {WINDOW}
    max_wait: 1s
    handler: {handler}
{fair}"""


def herd_rules() -> str:
    """Two rules; room for the herd and the other rule's keys pending at once."""
    return f"""\
namespace: {NS}
shards: 1
limits: {{pending_keys: 2000000}}
defaults:
  absorb: 20ms
  timeout: 30s
  window: {WINDOW}
  max_wait: 1s
rules:
  - name: herd
    match: "h:{{id}}"
    handler: bench.fairness:started
  - name: other
    match: "o:{{id}}"
    handler: bench.fairness:started
"""


def fair_refused(text: str) -> str | None:
    """Why these rules cannot load here (``fair:`` not known to this code), else None."""
    try:
        Config.from_string(text, source="<bench>")
    except ConfigError as exc:
        return f"fair: not taken by this code ({str(exc).splitlines()[0]})"
    return None


@contextlib.asynccontextmanager
async def node(server: Server, text: str, *, worker: bool = True) -> AsyncIterator[Coalescer]:
    config = Config.from_string(text, source="<bench>")
    async with Coalescer(config, redis_url=server.url, worker=worker,
                         node_id="fair-bench") as c:
        if worker:
            await asyncio.sleep(0.3)  # leadership taken
        yield c


def tkey(org: str, i: int) -> str:
    return f"t:{org}:{i}"


async def wait_count(group: str, n: int, timeout: float = DRAIN_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while STARTS.seen(group) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return STARTS.seen(group) >= n


def lag_figures(group: str) -> dict[str, Any]:
    return C.percentiles(STARTS.lags_ms.get(group, []))


def drain_figures(group: str, n: int) -> dict[str, Any]:
    times = sorted(STARTS.times.get(group, []))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {"keys": n, "started": len(times), "drain_s": span,
            "per_second": (len(times) - 1) / span if span > 0 else None}


def load_note() -> dict[str, Any]:
    return {"load_average": list(os.getloadavg())}


# -- (a) one tenant's import against a quiet tenant ------------------------------------


IMPORT_RULE = """\
  - name: u
    match: "u:{org}:{id}"
    window: 100ms
    max_wait: 1s
    handler: bench.fairness:started
"""


async def skew(server: Server, sizes: C.Sizes, fair: bool,
               apart: bool = False, work: bool = False) -> dict[str, Any]:
    """``apart``: the import goes to another rule (``u:{org}:{id}``, no ``fair``), the
    quiet tenant's rule keeps only its own keys: what the import's writing alone costs
    the quiet tenant, rules being apart. ``work``: the ``skew_work`` shape."""
    fs = sizes_of(sizes)
    handler = "bench.fairness:started_then_work" if work else "bench.fairness:started"
    text = (tenant_rules(fair_block() if fair else "", handler=handler)
            + (IMPORT_RULE if apart else ""))
    if fair and (why := fair_refused(text)):
        return {"skipped": why}
    STARTS.reset(await C.clock_offset_ms(server.url))
    n = fs.fair_import_work if work else fs.fair_import
    async with node(server, text) as c:
        stop = asyncio.Event()
        quiet = asyncio.create_task(_quiet_tenant(c, stop))
        await asyncio.sleep(4 * B_EVERY)  # the quiet tenant's lag before the import
        t0 = time.time()
        await import_keys(server, text, "u:a:{}" if apart else "t:a:{}", n)
        touched_s = time.time() - t0
        drained = await wait_count("a", n)
        await asyncio.sleep(4 * B_EVERY)  # and after it
        stop.set()
        sent = await quiet
        await wait_count("b", sent, timeout=10)
    out = {"fair": fair, "import_keys": n, "import_touch_s": touched_s, "drained": drained,
           "a": drain_figures("a", n), "b": lag_figures("b"), "b_touches": sent,
           "b_during_import": _lags_between("b", *_span("a")),
           "b_samples": _samples("b", t0), **load_note()}
    out["per_second"] = out["a"]["per_second"]
    return out


IMPORT = """\
import asyncio, sys
from coalescer import Coalescer, Config
async def main(url, template, n, at):
    config = Config.from_string(sys.stdin.read(), source="<bench>", import_handlers=False)
    async with Coalescer(config, redis_url=url, worker=False) as c:
        keys = (template.format(i) for i in range(n))
        await c.touch_many_wait(keys, timeout=None, at=float(at) if at != "-" else None)
        await c.flush()
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
"""


async def import_keys(server: Server, text: str, template: str, n: int,
                      at: float | None = None) -> None:
    """``n`` keys (``template.format(i)``) touched at once, at time ``at`` if given, from
    a process of its own (an app's import, not the node's: the node's loop and heap are
    not the writer's)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", IMPORT, server.url, template, str(n),
        "-" if at is None else repr(at), stdin=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate(text.encode())
    if proc.returncode != 0:
        raise RuntimeError(f"the import process failed: {err.decode()[-2000:]}")


async def _quiet_tenant(c: Coalescer, stop: asyncio.Event) -> int:
    i = 0
    while not stop.is_set():
        c.touch(tkey("b", i))
        i += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), B_EVERY)
    return i


def _samples(group: str, t0: float) -> list[tuple[float, float]]:
    """Each start of ``group``: seconds since ``t0`` and its lag (ms), for a look at when
    the lag came."""
    pairs = zip(STARTS.times.get(group, []), STARTS.lags_ms.get(group, []), strict=True)
    return [(round(t - t0, 3), round(lag, 1)) for t, lag in pairs]


def _span(group: str) -> tuple[float, float]:
    times = STARTS.times.get(group) or [0.0]
    return min(times), max(times)


def _lags_between(group: str, t0: float, t1: float) -> dict[str, Any]:
    """The lags of ``group``'s starts between ``t0`` and ``t1`` (another group's drain)."""
    pairs = zip(STARTS.times.get(group, []), STARTS.lags_ms.get(group, []), strict=True)
    return C.percentiles([lag for t, lag in pairs if t0 <= t <= t1])


# -- (b) balanced tenants ----------------------------------------------------------------


async def balanced(server: Server, sizes: C.Sizes, fair: bool) -> dict[str, Any]:
    fs = sizes_of(sizes)
    text = tenant_rules(fair_block() if fair else "")
    if fair and (why := fair_refused(text)):
        return {"skipped": why}
    STARTS.reset(await C.clock_offset_ms(server.url))
    tenants = [f"q{j}" for j in range(BALANCED_TENANTS)]
    n = fs.fair_balanced
    keys = [tkey(org, i) for i in range(n) for org in tenants]
    async with node(server, text) as c:
        await C.touch_distinct(c, keys)
        await c.flush()
        done = [await wait_count(org, n) for org in tenants]
    per = {org: {**lag_figures(org), **drain_figures(org, n)} for org in tenants}
    t0 = min(_span(org)[0] for org in tenants)
    t1 = max(_span(org)[1] for org in tenants)
    return {"fair": fair, "tenants": per, "drained": all(done),
            "p50": max(p["p50"] for p in per.values()),
            "p99": max(p["p99"] for p in per.values()),
            "per_second": len(keys) / (t1 - t0) if t1 > t0 else None, **load_note()}


# -- (c) weights -------------------------------------------------------------------------


async def weights(server: Server, sizes: C.Sizes, fair: bool) -> dict[str, Any]:
    """Shares of the first ``fair_weights`` starts among three backlogged tenants.
    Their keys are written before the node starts (all due at once)."""
    fs = sizes_of(sizes)
    text = tenant_rules(fair_block(weights=WEIGHTS) if fair else "")
    if fair and (why := fair_refused(text)):
        return {"skipped": why}
    n = fs.fair_weights
    keys = [tkey(org, i) for i in range(n) for org in WEIGHTS]
    async with node(server, text, worker=False) as w:
        await C.touch_distinct(w, keys)
        await w.flush()
    await asyncio.sleep(0.3)  # every key due
    STARTS.reset(await C.clock_offset_ms(server.url))
    async with node(server, text):
        await _wait_total(n)
        first = _first_shares(n)
    return {"fair": fair, "claims": n, "counts": first, **_share_errors(first, n),
            **load_note()}


async def _wait_total(n: int) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while STARTS.count < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _first_shares(n: int) -> dict[str, int]:
    """Per tenant, how many of the first ``n`` starts (by start time) were its."""
    merged = sorted((t, org) for org, ts in STARTS.times.items() for t in ts)[:n]
    counts = {org: 0 for org in WEIGHTS}
    for _, org in merged:
        counts[org] = counts.get(org, 0) + 1
    return counts


def _share_errors(counts: dict[str, int], n: int) -> dict[str, Any]:
    """Each tenant's share against its weight's, and the largest error (relative, %)."""
    total_w = sum(WEIGHTS.values())
    got = {org: counts.get(org, 0) / max(1, n) for org in WEIGHTS}
    want = {org: w / total_w for org, w in WEIGHTS.items()}
    rel = {org: (got[org] / want[org] - 1) * 100 for org in WEIGHTS}
    return {"shares": got, "expected": want, "error_percent": rel,
            "max_error_percent": max(abs(v) for v in rel.values())}


# -- (e) a herd of one rule against another rule ---------------------------------------


async def herd(server: Server, sizes: C.Sizes, with_herd: bool = True) -> dict[str, Any]:
    """``other``'s start lag while ``sizes.herd`` keys of ``herd`` drain (``with_herd``
    False: the same node and touches with no herd, the figure beside it)."""
    fs = sizes_of(sizes)
    n = fs.herd if with_herd else 0
    STARTS.reset(await C.clock_offset_ms(server.url))
    async with node(server, herd_rules()) as c:
        t0 = time.time()
        # the scheduling's time (a process's start included), and a lead
        due_at = t0 + fs.herd_lead + IMPORT_START + n / SCHEDULE_RATE
        await import_keys(server, herd_rules(), "h:{}", n, at=due_at)
        scheduled_s = time.time() - t0
        await asyncio.sleep(max(0.0, due_at - fs.herd_lead / 2 - time.time()))
        stop = asyncio.Event()
        ticker = asyncio.create_task(_other_rule(c, stop))
        loop_stalls = asyncio.create_task(_loop_stalls(stop))
        machine: dict[str, Any] = {}
        with stall_probe(machine):
            drained = await wait_count("herd", n, timeout=HERD_DRAIN_TIMEOUT)
            await asyncio.sleep(max(0.0, due_at + fs.herd_lead - time.time()))  # touches after
            stop.set()
        sent = await ticker
        await wait_count("other", sent, timeout=10)
    return {"herd": n, "scheduled_s": scheduled_s, "scheduled_late": t0 + scheduled_s > due_at,
            "drained": drained,
            "herd_drain": drain_figures("herd", n), "other_touches": sent,
            **lag_figures("other"), "during_herd": _lags_between("other", *_span("herd")),
            "loop": await loop_stalls, **machine, **load_note()}


async def _loop_stalls(stop: asyncio.Event) -> dict[str, Any]:
    """How late this process's event loop (the node's) woke a 1 ms sleep: over 5 ms, and
    the longest; beside the idle process's figures (``machine``), it tells the node's own
    stalls from the machine's."""
    late: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        ms = (time.perf_counter() - t) * 1000 - 1
        if ms > 5:
            late.append(ms)
    return {"stalls_over_5ms": len(late), "max_stall_ms": max(late, default=0.0)}


async def _other_rule(c: Coalescer, stop: asyncio.Event) -> int:
    i = 0
    t0 = time.monotonic()
    while not stop.is_set():
        c.touch(f"o:{i}")
        i += 1
        await asyncio.sleep(max(0.0, t0 + i * OTHER_EVERY - time.monotonic()))
    return i


# -- (f) memory --------------------------------------------------------------------------


async def memory(server: Server, sizes: C.Sizes, fair: bool) -> dict[str, Any]:
    """Bytes per pending key (``memory_keys`` over ``MEMORY_TENANTS`` tenants) scheduled
    an hour ahead, beyond the look-ahead of a fair rule's queues, and written with the
    rule's window (each in its tenant's queue with ``fair``), and per tenant
    (``fair_groups`` tenants of one key each), read with ``used_memory``; a claim call
    first, as a node's, publishes the rule's queues for the writes."""
    fs = sizes_of(sizes)
    text = tenant_rules(fair_block() if fair else "")
    if fair and (why := fair_refused(text)):
        return {"skipped": why}
    many = [tkey(f"m{i % MEMORY_TENANTS}", i) for i in range(fs.memory_keys)]
    later = [tkey(f"l{i % MEMORY_TENANTS}", i) for i in range(fs.memory_keys)]
    groups = [tkey(f"g{i}", 0) for i in range(fs.fair_groups)]
    config = Config.from_string(text, source="<bench>")
    async with node(server, text, worker=False) as w:
        per_later = await _bytes_per(server, config, w, later, delay=3600)
        per_key = await _bytes_per(server, config, w, many)
        per_group = await _bytes_per(server, config, w, groups)
    return {"fair": fair, "keys": len(many), "tenants": MEMORY_TENANTS,
            "pending_bytes_per_key": per_later, "bytes_per_key": per_key,
            "groups": len(groups), "bytes_per_group_key": per_group, **load_note()}


async def _bytes_per(server: Server, config: Config, w: Coalescer, keys: list[str],
                     delay: float | None = None) -> float:
    """Bytes per key of ``keys`` written (each ``delay`` s ahead, else the rule's window)
    on an emptied server (the keys before would count against the pending-bytes limit)."""
    sync = server.client(timeout=60)
    try:
        sync.execute_command("FLUSHALL", "SYNC")
        w.touch(tkey("warm", 0))
        await w.flush()
        await _claim_once(server, config)
        before = used_memory(sync)
        await C.touch_distinct(w, keys, delay=delay)
        await w.flush()
        return (used_memory(sync) - before) / max(1, len(keys))
    finally:
        sync.close()


async def _claim_once(server: Server, config: Config) -> None:
    """One claim call of the rule, as a node makes at start."""
    r = Redis.from_url(server.url, decode_responses=True)
    scripts = Scripts(r)
    try:
        state = await scripts.acquire(SHARD, node_id="bench-mem", lease_ms=600_000, mine="")
        await scripts.claim(SHARD, leader=state.holder, node_id="bench-mem",
                            claim_lease_ms=600_000, sleep_cap_ms=1000,
                            limits=[(RULE, 1)], fair=fair_rules(config.rules))
    finally:
        await r.aclose()
