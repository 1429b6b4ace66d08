"""Figures of the rate throttle and of bulk writers that wait for room.

``throttle_coalescer``: a rule at ``rate: 200/s`` served by two `coalescer run` node
processes (4 shards, each process leading two), ``keys`` keys due at once; every
refresh start is logged by the process that ran it (``bench.probe:buffered``). The
rate is the starts after the first one over the time from the first start to the
last, so the bucket's initial burst (a tenth of a second's starts) is part of it,
as a user sees it; each process's share is recorded too.

``bulk_touch`` / ``bulk_touch_wait``: one ``SyncCoalescer`` (the default buffer of
100,000 keys, or one of 10,000), 16 threads touching ``bulk_keys`` distinct keys
between them as fast as a loop can, with ``touch`` (a refused key is counted and
skipped: lost for this import) or with ``touch_wait`` (waits for room, up to its
default 30 s); keys/s until ``flush`` returns, and the keys Redis holds counted.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from coalescer import BackpressureError, Coalescer, SyncCoalescer
from coalescer.store.connection import connect
from coalescer.store.keys import KeySpace

from . import common as C
from . import probe
from .valkey import Server

RATE = 200  # starts a second
SHARDS = 4
NODES = 2
THREADS = 16
DEFAULT_BUFFER = 100_000  # Coalescer's max_buffered by default
SMALL_BUFFER = 10_000  # a buffer a tenth of the import


def _rules(concurrency: int = 64) -> str:
    return C.rules_text(window="1s", max_wait="10s", concurrency=concurrency, shards=SHARDS,
                        handler="bench.probe:buffered").replace(
        "    handler: bench.probe:buffered\n",
        f"    handler: bench.probe:buffered\n    rate: {RATE}/s\n")


async def throttle_coalescer(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    """Starts/s of a rule at ``rate: 200/s`` over two node processes."""
    folder = tmp / "throttle"
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yaml"
    rules.write_text(_rules())
    log = folder / f"starts-{time.time_ns()}.log"
    procs = [C.spawn_node(server.url, rules, f"t{n}", log, folder / f"node-{n}.out", grace=5)
             for n in range(NODES)]
    space = KeySpace(C.NS, SHARDS)
    conn = await connect(server.url)
    try:
        leads = await C.wait_led(conn.client, space, NODES)
        keys = [C.key(i) for i in range(sizes.throttle_keys)]
        writer = SyncCoalescer.from_yaml(rules, redis_url=server.url)
        with writer:
            await asyncio.to_thread(writer.touch_many_wait, keys)
            await asyncio.to_thread(writer.flush)
        await C.wait_for(lambda: _settled(conn.client, space), 60 + len(keys) / RATE * 2,
                          "every throttled key refreshed")
    finally:
        await conn.close()
        for proc in procs:
            C.stop_process(proc)
    return _rate_figures(log, len(keys), leads)


async def _settled(r: Any, space: KeySpace) -> bool:
    pending = await asyncio.gather(*(r.zcard(sk.due(C.RULE)) for sk in space.all_shards()),
                                   *(r.zcard(sk.inflight(C.RULE)) for sk in space.all_shards()))
    return bool(sum(pending) == 0)


def _rate_figures(log: Path, n_keys: int, leads: dict[str, int]) -> dict[str, Any]:
    per_process = {p.name.rsplit(".", 1)[-1]: probe.read_log(p)
                   for p in sorted(log.parent.glob(f"{log.name}.*"))}
    starts = sorted(t for lines in per_process.values() for t, _ in lines)
    keys = {k for lines in per_process.values() for _, k in lines}
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    per_second = (len(starts) - 1) / span if span > 0 else None
    steady = [t for t in starts if t >= starts[0] + 1.0]  # past the first second's burst
    steady_span = starts[-1] - (starts[0] + 1.0)
    return {"keys": n_keys, "rate": RATE, "starts": len(starts), "keys_started": len(keys),
            "lost": n_keys - len(keys), "touches": n_keys,
            "per_second": per_second,
            "steady_per_second": (len(steady) - 1) / steady_span if steady_span > 0 else None,
            "off_percent": None if per_second is None else (per_second / RATE - 1) * 100,
            "span_seconds": span, "leads": leads,
            "starts_per_process": {pid: len(v) for pid, v in per_process.items()}}


async def bulk_touch(server: Server, sizes: C.Sizes,
                     buffer: int = DEFAULT_BUFFER) -> dict[str, Any]:
    """16 threads touching distinct keys with ``touch``: refusals counted and skipped."""
    return await asyncio.to_thread(_bulk, server, sizes.bulk_keys, buffer, waiting=False)


async def bulk_touch_wait(server: Server, sizes: C.Sizes,
                          buffer: int = DEFAULT_BUFFER) -> dict[str, Any]:
    """The same with ``touch_wait``: it waits for room instead."""
    return await asyncio.to_thread(_bulk, server, sizes.bulk_keys, buffer, waiting=True)


def _bulk(server: Server, n_keys: int, buffer: int, *, waiting: bool) -> dict[str, Any]:
    config = C.config(window="1m", max_wait="5m")
    refused = [0] * THREADS
    go = threading.Barrier(THREADS + 1)
    with SyncCoalescer(Coalescer(config, redis_url=server.url, worker=False,
                                 max_buffered=buffer)) as c:
        def write(n: int) -> None:
            touch = c.touch_wait if waiting else c.touch
            go.wait()
            for i in range(n, n_keys, THREADS):
                try:
                    touch(C.key(i))
                except BackpressureError:
                    refused[n] += 1

        threads = [threading.Thread(target=write, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        c.flush(timeout=120)
        seconds = time.perf_counter() - t0
    with server.client() as r:
        stored = r.zcard(KeySpace(C.NS, 1).shard(0).due(C.RULE))
    return {"keys": n_keys, "threads": THREADS, "buffer": buffer, "refused": sum(refused),
            "stored": stored,
            "missing": n_keys - stored, "seconds": seconds, "per_second": stored / seconds}
