"""Distinct keys/s into Redis from one process: 1 writer thread against 16.

    .venv/bin/python -m bench.threads [--keys N] [--threads T] [--repeats R]
                                      [--mode sync|async|both]

Each measurement: a fresh valkey-server, one write-path coalescer (``worker=False``,
window 1 h, so nothing is claimed meanwhile) and N never-seen keys (300,000), split
between the writer threads (1, then T: 16) in runs: each thread has its own stretch of
the list, as each request builds its own keys. (Dealt out one by one instead, thread i
taking keys i, i+T, i+2T..., the T threads paid cache misses on the bench's own list
of key strings that one thread walking it in order does not: 0.3 us a key, a tenth of
the ratio.) Each thread calls ``touch(key)`` on its
share in a loop; a touch refused for a full buffer (BackpressureError) is counted and
tried again 1 ms later. The clock runs from the moment every thread is released to
``flush()`` returning, when Redis holds every key (checked after the clock stops:
``ZCARD`` of the due set). keys/s = N / that time.

``--mode sync``: a ``SyncCoalescer`` (its loop in a thread of its own, as in a Django
or gunicorn gthread process); ``async``: a ``Coalescer`` on the main thread's running
loop, fed from threads (as the thread pool of an async app's sync endpoints).

Each of the R rounds (3) runs 1 thread, then T threads, so a change of the machine's
load weighs on both; the table gives min / median / max of each and the ratio of the
medians, and each round's own ratio. Also per key: the process's CPU (user + sys,
``getrusage``) and its context switches, voluntary + involuntary; the touches refused;
and how long the final ``flush()`` took after the last writer ended (the keys still
buffered then are written with no touching left to overlap).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coalescer import Coalescer
from coalescer.errors import BackpressureError
from coalescer.store.keys import KeySpace
from coalescer.sync import SyncCoalescer

from . import common as C
from .valkey import Server

RETRY = 0.001  # seconds a refused writer waits before touching the key again
FLUSH_TIMEOUT = 120.0


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_nvcsw + ru.ru_nivcsw


class Writers:
    """``n`` threads, each touching its share of ``keys`` once, released together."""

    def __init__(self, touch: Callable[[str], None], keys: list[str], n: int) -> None:
        self.refused = [0] * n
        self._touch = touch
        self._go = threading.Barrier(n + 1)
        share = -(-len(keys) // n)
        self._threads = [threading.Thread(target=self._write,
                                          args=(i, keys[i * share:(i + 1) * share]),
                                          name=f"writer-{i}") for i in range(n)]
        for t in self._threads:
            t.start()

    def _write(self, i: int, keys: list[str]) -> None:
        touch = self._touch
        self._go.wait()
        for key in keys:
            while True:
                try:
                    touch(key)
                    break
                except BackpressureError:
                    self.refused[i] += 1
                    time.sleep(RETRY)

    def release(self) -> None:
        self._go.wait()

    def join(self) -> None:
        for t in self._threads:
            t.join()


def _result(keys: int, threads: int, seconds: float, *, tail: float,
            start: tuple[float, int], writers: Writers) -> dict[str, Any]:
    cpu, switches = _usage()
    return {"keys": keys, "threads": threads, "seconds": seconds, "tail_seconds": tail,
            "per_second": keys / seconds, "refused": sum(writers.refused),
            "cpu_us_per_key": (cpu - start[0]) * 1e6 / keys,
            "switches_per_key": (switches - start[1]) / keys}


def _sync_run(server: Server, keys: list[str], threads: int) -> dict[str, Any]:
    coalescer = Coalescer(C.config(window="1h", max_wait="2h"), redis_url=server.url,
                          worker=False)
    with SyncCoalescer(coalescer) as c:
        writers = Writers(c.touch, keys, threads)
        start = _usage()
        writers.release()
        t0 = time.perf_counter()
        writers.join()
        t1 = time.perf_counter()
        c.flush(timeout=FLUSH_TIMEOUT)
        seconds = time.perf_counter() - t0
        out = _result(len(keys), threads, seconds, tail=t0 + seconds - t1, start=start,
                      writers=writers)
    return out


async def _async_run(server: Server, keys: list[str], threads: int) -> dict[str, Any]:
    coalescer = Coalescer(C.config(window="1h", max_wait="2h"), redis_url=server.url,
                          worker=False)
    async with coalescer as c:
        writers = Writers(c.touch, keys, threads)
        start = _usage()
        await asyncio.to_thread(writers.release)
        t0 = time.perf_counter()
        await asyncio.to_thread(writers.join)
        t1 = time.perf_counter()
        await asyncio.wait_for(c.flush(), FLUSH_TIMEOUT)
        seconds = time.perf_counter() - t0
        out = _result(len(keys), threads, seconds, tail=t0 + seconds - t1, start=start,
                      writers=writers)
    return out


def measure(mode: str, n: int, threads: int) -> dict[str, Any]:
    """One measurement on a fresh server; raises if Redis does not hold every key."""
    keys = [C.key(i) for i in range(n)]
    gc.collect()
    gc.freeze()
    with tempfile.TemporaryDirectory() as folder, Server(Path(folder)) as server:
        if mode == "sync":
            out = _sync_run(server, keys, threads)
        else:
            out = asyncio.run(_async_run(server, keys, threads))
        with server.client() as r:
            held = r.zcard(KeySpace(C.NS, 1).shard(0).due(C.RULE))
    if held != n:
        raise RuntimeError(f"{mode}, {threads} threads: Redis holds {held} of {n} keys")
    return out


def _spread(runs: list[dict[str, Any]], field: str) -> str:
    values = sorted(r[field] for r in runs)
    return " / ".join(_fmt(v) for v in (values[0], statistics.median(values), values[-1]))


def _fmt(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.2f}"


def report(mode: str, one: list[dict[str, Any]], many: list[dict[str, Any]]) -> None:
    ratio = (statistics.median(r["per_second"] for r in many)
             / statistics.median(r["per_second"] for r in one))
    each = ", ".join(f"{m['per_second'] / o['per_second']:.2f}x"
                     for o, m in zip(one, many, strict=True))
    threads = many[0]["threads"]
    print(f"\n{mode}: distinct keys/s into Redis, {one[0]['keys']:,} keys "
          "(min / median / max)")
    for label, runs in (("1 thread", one), (f"{threads} threads", many)):
        print(f"  {label:<11} {_spread(runs, 'per_second'):>24} keys/s   CPU "
              f"{_spread(runs, 'cpu_us_per_key')} us/key   switches "
              f"{_spread(runs, 'switches_per_key')}/key   refused "
              f"{sum(r['refused'] for r in runs)}   flush after the last touch "
              f"{_spread(runs, 'tail_seconds')} s")
    print(f"  ratio {threads} / 1: {ratio:.2f}x of the medians (each round: {each})")


def main(n: int, threads: int, repeats: int, modes: list[str]) -> None:
    for mode in modes:
        one: list[dict[str, Any]] = []
        many: list[dict[str, Any]] = []
        for i in range(repeats):
            one.append(measure(mode, n, 1))
            many.append(measure(mode, n, threads))
            print(f"{mode} round {i + 1}: 1 thread {one[-1]['per_second']:,.0f} keys/s, "
                  f"{threads} threads {many[-1]['per_second']:,.0f} keys/s", flush=True)
        report(mode, one, many)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=300_000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("sync", "async", "both"), default="both")
    options = parser.parse_args()
    chosen = ["sync", "async"] if options.mode == "both" else [options.mode]
    main(options.keys, options.threads, options.repeats, chosen)
