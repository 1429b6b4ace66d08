"""The peers a user would pick instead of coalescer, on the same server and workloads.

- **arq** (Python, asyncio): a touch is ``enqueue_job("refresh", key, _job_id=key,
  _defer_by=WINDOW)``, the way arq's docs deduplicate a job: while a job with that id
  is queued or running, the enqueue is refused (returns None). The worker's function
  has ``keep_result=0`` (else a finished job's result blocks its id for an hour) and
  ``max_jobs=16`` (coalescer's default concurrency); everything else is arq's default
  (a 0.5 s poll).
- **BullMQ** (Node): ``bench/bullmq/peer.mjs``, one subprocess per measurement, driven
  with a JSON request and answering JSON. A touch is ``queue.add`` with ``delay: W`` and
  ``deduplication: {id, ttl: W, extend: true, replace: true, keepLastIfActive: true}``;
  the worker's concurrency is 16. Runs only where ``node`` and ``npm`` are; the first
  measurement runs ``npm install`` in bench/bullmq (node_modules is not tracked).

Every function returns what the coalescer one of the same workload returns, or
``{"skipped": "why"}`` when the peer cannot be measured here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from . import common as C
from . import figures as F
from .probe import REC
from .valkey import MonitorCounter, Server

BULLMQ_DIR = Path(__file__).resolve().parent / "bullmq"
PEER_CONCURRENCY = 16  # both peers' workers, as coalescer's default
NODE_TIMEOUT = 140.0


# -- arq ---------------------------------------------------------------------------------


def _arq() -> Any:
    try:
        import arq  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # the bench extra installs it
        return None
    return arq


async def _arq_refresh(ctx: dict[str, Any], key: str) -> None:
    await REC.refresh(key, float(ctx["score"]))  # score: the job's due time, epoch ms


class Arq:
    """An arq pool (the write path) and optionally a worker, on one server."""

    def __init__(self, server: Server, window: float) -> None:
        self.server = server
        self.window = window
        self.pool: Any = None
        self.worker: Any = None
        self._task: asyncio.Task[Any] | None = None
        self.refused = 0

    async def __aenter__(self) -> Arq:
        arq = _arq()
        from arq.connections import RedisSettings  # type: ignore[import-not-found, unused-ignore]
        self.settings = RedisSettings(host="127.0.0.1", port=self.server.port)
        self.pool = await arq.create_pool(self.settings)
        return self

    def start_worker(self) -> None:
        from arq.worker import Worker, func  # type: ignore[import-not-found, unused-ignore]
        self.worker = Worker(functions=[func(_arq_refresh, name="refresh", keep_result=0)],
                             redis_settings=self.settings, max_jobs=PEER_CONCURRENCY,
                             handle_signals=False, keep_result=0)
        self._task = asyncio.create_task(self.worker.async_run())

    async def touch(self, key: str) -> None:
        job = await self.pool.enqueue_job("refresh", key, _job_id=key, _defer_by=self.window)
        if job is None:
            self.refused += 1

    async def scheduled(self) -> set[str]:
        from arq.constants import default_queue_name  # type: ignore[import-not-found, unused-ignore]
        return {str(k.decode() if isinstance(k, bytes) else k)
                for k in await self.pool.zrange(default_queue_name, 0, -1)}

    async def settled(self) -> bool:
        from arq.constants import default_queue_name  # type: ignore[import-not-found, unused-ignore]
        return bool(await self.pool.zcard(default_queue_name) == 0 and REC.running == 0)

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.worker is not None:  # its running jobs; a cancelled one must not escape
            closing = asyncio.ensure_future(self.worker.close())
            await asyncio.wait([closing], timeout=10)
            if not closing.done():
                closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)
        await self.pool.aclose()


def _arq_missing() -> dict[str, Any] | None:
    return None if _arq() else {"skipped": "arq is not installed (pip install -e '.[dev,bench]')"}


async def _arq_touches(server: Server, sizes: C.Sizes, *, n: int, seconds: float,
                       window: float, work: float, pick: Any) -> dict[str, Any]:
    REC.reset(offset_ms=0.0, work=work)
    touches: dict[str, list[float]] = defaultdict(list)
    async with Arq(server, window) as a:
        a.start_worker()

        async def one(i: int) -> None:
            k = pick(i)
            await a.touch(k)
            touches[k].append(time.time())
        await C.paced(n, seconds, one)
        await C.settle(a.settled, timeout=window + 8)
        out = C.lost_updates(touches, REC.starts, await a.scheduled())
        out["refused_enqueues"] = a.refused
    return out


async def burst_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    return _arq_missing() or await _arq_touches(
        server, sizes, n=F.BURST_TOUCHES, seconds=F.BURST_SECONDS, window=F.BURST_WINDOW,
        work=F.BURST_WORK, pick=lambda _i: C.HOT_KEY)


async def churn_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    rng = random.Random(7)
    return await _arq_touches(
        server, sizes, n=int(F.CHURN_RATE * sizes.churn_seconds), seconds=sizes.churn_seconds,
        window=F.CHURN_WINDOW, work=F.CHURN_WORK,
        pick=lambda _i: C.key(rng.randrange(F.CHURN_KEYS)))


async def hot_key_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    async with Arq(server, 3600) as a:
        t0 = time.perf_counter()
        for _ in range(sizes.peer_hot_touches):
            await a.touch(C.HOT_KEY)
        dt = time.perf_counter() - t0
    n = sizes.peer_hot_touches
    return {"calls": n, "seconds": dt, "per_second": n / dt}


async def distinct_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    from arq.constants import default_queue_name  # type: ignore[import-not-found, unused-ignore]
    keys = [C.key(i) for i in range(sizes.distinct_baseline)]
    async with Arq(server, 3600) as a:
        t0 = time.perf_counter()
        for k in keys:
            await a.touch(k)
        dt = time.perf_counter() - t0
        held = await a.pool.zcard(default_queue_name)
    return {"keys": len(keys), "seconds": dt, "per_second": len(keys) / dt,
            "redis_holds": held}


async def lag_arq(server: Server, sizes: C.Sizes, rate: int) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    from arq.constants import default_queue_name  # type: ignore[import-not-found, unused-ignore]
    REC.reset(offset_ms=0.0)
    n = int(rate * sizes.lag_seconds)
    touches: dict[str, list[float]] = {}
    async with Arq(server, F.LAG_WINDOW) as a:
        a.start_worker()

        async def one(i: int) -> None:
            k = C.key(i)
            await a.touch(k)
            touches[k] = [time.time()]
        await C.paced(n, sizes.lag_seconds, one)
        await C.settle(a.settled, timeout=sizes.lag_settle)
        scheduled = await a.scheduled()
        now = time.time() * 1000
        scores = await a.pool.zrange(default_queue_name, 0, -1, withscores=True)
        censored = [now - float(s) for _, s in scores if now > float(s)]
        g1 = C.lost_updates(touches, REC.starts, scheduled)
    out = C.percentiles(REC.lags_ms, censored)
    out.update(rate=rate, keys=n, g1=g1, window=F.LAG_WINDOW, concurrency=PEER_CONCURRENCY)
    return out


async def drain_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    n = sizes.drain_baseline_keys
    keys = [C.key(i) for i in range(n)]
    REC.reset(offset_ms=0.0)
    async with Arq(server, 0.1) as a:
        for k in keys:
            await a.touch(k)
        t_loaded = time.time()
        await asyncio.sleep(0.3)  # every key is due
        a.start_worker()
        deadline = time.monotonic() + 60
        while REC.count < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await C.settle(a.settled, timeout=10, stable=0.0)
        t_done = time.time()
        scheduled = await a.scheduled()
    first = REC.first or t_done
    return {"keys": n, "refreshed": REC.count, "concurrency": PEER_CONCURRENCY,
            "per_second": REC.count / max(1e-9, t_done - first), "drain_seconds": t_done - first,
            "g1": C.lost_updates({k: [t_loaded] for k in keys}, REC.starts, scheduled)}


@contextlib.asynccontextmanager
async def _arq_worker(server: Server) -> AsyncIterator[Arq]:
    async with Arq(server, 1.0) as a:
        a.start_worker()
        yield a


async def idle_arq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (missing := _arq_missing()) is not None:
        return missing
    return await C.idle_commands(server, lambda: _arq_worker(server), 1.5, sizes.idle_seconds)


# -- BullMQ ------------------------------------------------------------------------------


_NPM: dict[str, str | None] = {}


def bullmq_unavailable() -> str | None:
    """Why BullMQ cannot be measured here (None: it can); runs `npm install` once."""
    if "why" in _NPM:
        return _NPM["why"]
    why: str | None = None
    if shutil.which("node") is None or shutil.which("npm") is None:
        why = "node/npm not found on PATH"
    elif not all((BULLMQ_DIR / "node_modules" / m).exists() for m in ("bullmq", "ioredis")):
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=BULLMQ_DIR,
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            why = f"npm install in bench/bullmq failed: {tail}"
    _NPM["why"] = why
    if why:
        print(f"\n  BullMQ skipped: {why}", flush=True)
    return why


def bullmq_version() -> str:
    try:
        meta = json.loads((BULLMQ_DIR / "node_modules" / "bullmq" / "package.json").read_text())
    except (OSError, ValueError):
        return "?"
    return str(meta.get("version", "?"))


async def _node(server: Server, workload: str, **params: Any) -> dict[str, Any]:
    request = json.dumps({"workload": workload, "url": server.url,
                          "bullmq_version": bullmq_version(), **params})
    proc = await asyncio.create_subprocess_exec(
        "node", str(BULLMQ_DIR / "peer.mjs"), request, cwd=BULLMQ_DIR,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), NODE_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines() or ["?"]
        first = next((x for x in lines if "Error" in x), lines[0])
        raise RuntimeError(f"bullmq {workload} exited {proc.returncode}: {first[:300]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def _g1(raw: dict[str, Any]) -> dict[str, Any]:
    return C.lost_updates(raw["touches"], raw["starts"], raw["scheduled"], raw["per_key"])


async def burst_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    raw = await _node(server, "burst", key=C.HOT_KEY, touches=F.BURST_TOUCHES,
                      seconds=F.BURST_SECONDS, window_ms=F.BURST_WINDOW * 1000,
                      work_ms=F.BURST_WORK * 1000)
    return {**_g1(raw), "bullmq": raw["bullmq"]}


async def churn_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    raw = await _node(server, "churn", keys=F.CHURN_KEYS,
                      touches=int(F.CHURN_RATE * sizes.churn_seconds),
                      seconds=sizes.churn_seconds, window_ms=F.CHURN_WINDOW * 1000,
                      work_ms=F.CHURN_WORK * 1000)
    return {**_g1(raw), "bullmq": raw["bullmq"]}


async def hot_key_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    return await _node(server, "hot_key", key=C.HOT_KEY, calls=sizes.peer_hot_touches,
                       window_ms=3_600_000)


async def distinct_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    return await _node(server, "distinct", keys=sizes.distinct_baseline, window_ms=3_600_000)


async def lag_bullmq(server: Server, sizes: C.Sizes, rate: int) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    raw = await _node(server, "lag", rate=rate, seconds=sizes.lag_seconds,
                      window_ms=F.LAG_WINDOW * 1000, settle_s=sizes.lag_settle)
    out = C.percentiles(raw["lags_ms"], raw["censored_ms"])
    out.update(rate=rate, keys=len(raw["touches"]), g1=_g1(raw), window=F.LAG_WINDOW,
               concurrency=PEER_CONCURRENCY, bullmq=raw["bullmq"])
    return out


async def drain_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    raw = await _node(server, "drain", keys=sizes.drain_baseline_keys, max_seconds=60)
    g1 = _g1(raw)
    for name in ("touches", "starts", "per_key", "scheduled"):
        raw.pop(name)
    return {**raw, "g1": g1}


async def idle_bullmq(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    if (why := bullmq_unavailable()) is not None:
        return {"skipped": why}
    mon = MonitorCounter(server.port)
    try:
        raw = await _node(server, "idle", warmup_s=1.5, seconds=sizes.idle_seconds)
        counted = mon.count(raw["t0"], raw["t1"])
    finally:
        mon.close()
    return {**C.idle_figures(counted, raw["t0"], raw["t1"]), "bullmq": raw["bullmq"]}
