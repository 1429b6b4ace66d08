"""What an idle worker node costs by the number of shards it leads, and failover time.

    .venv/bin/python -m bench.idle_shards [--shards 1,256,4096] [--seconds 20]
                                          [--failover 1,4096] [--busy 4096]

Each figure starts a fresh valkey-server and real ``coalescer run`` node processes
(127.0.0.1). *Idle*: one node leads every shard with nothing pending; once it leads
them all and has settled, the server's ``INFO commandstats`` is read before and after
a quiet window: commands/s as the server counts them (commands run inside scripts
included), the commands clients sent (script calls and plain commands, by MONITOR), and
the node process's CPU (user + system) as a % of one core. *Busy start*: a node
leading every shard started while spinning processes hold every core: how often its own
node lease lapsed in its first 20 s (from its log), then the same node's idle figure from
20 s after the load ended. *Failover*: two nodes
share the shards; the one leading shard 0 is SIGKILLed, and the figure is the time
until the other leads every shard the killed one led (leader_lease 3 s). *Write
path* (what does grow with the shard count): one process touches 100,000 distinct keys
and flushes them, as the ``distinct`` figure; keys/s into Redis, and Redis time per key.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from coalescer.store.keys import KeySpace

from .common import (
    NS,
    Sizes,
    coalescer,
    key,
    process_tree_cpu,
    rules_text,
    spawn_node,
    stop_process,
    touch_distinct,
)
from .valkey import MonitorCounter, Server, calls_delta, commandstats

LEASE = 3.0  # leader_lease of the rules below, seconds
SETTLE = 3.0  # seconds after the node leads every shard, before the window opens
SHARD_COUNTS = (1, 256, 4096)
FAILOVER_COUNTS = (1, 4096)
WRITE_COUNTS = (1, 16, 256, 4096)


def _node(folder: Path, server: Server, rules: Path, name: str) -> subprocess.Popen[bytes]:
    return spawn_node(server.url, rules, name, folder / f"refresh-{name}.log",
                      folder / f"node-{name}.out", grace=1)


def _rules(folder: Path, shards: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rules.yaml"
    path.write_text(rules_text(shards=shards, lease=f"{LEASE:g}s",
                               handler="bench.probe:logged"))
    return path


async def leaders(r: Any, shards: int) -> list[str | None]:
    """The node leading each shard (None: no leader), read in one pipeline."""
    space = KeySpace(NS, shards)
    pipe = r.pipeline(transaction=False)
    for sk in space.all_shards():
        pipe.get(sk.leader)
    return [str(v).split("|", 1)[1] if v else None for v in await pipe.execute()]


async def _until(pred: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(step)


async def idle(server: Server, sizes: Sizes, tmp: Path, shards: int,
               seconds: float = 20.0) -> dict[str, Any]:
    """An idle node leading ``shards`` shards: server-counted commands/s and CPU %."""
    folder = tmp / f"idle-{shards}"
    rules = _rules(folder, shards)
    r = Redis.from_url(server.url, decode_responses=True)
    proc = _node(folder, server, rules, "idle")
    try:
        async def all_led() -> bool:
            return all(n == "idle" for n in await leaders(r, shards))
        await _until(all_led, 120, f"the node leading all {shards} shards", 0.2)
        await asyncio.sleep(SETTLE)
        return {"shards": shards, **await _window(server, proc, seconds)}
    finally:
        stop_process(proc)
        await r.aclose()


async def _window(server: Server, proc: subprocess.Popen[bytes],
                  seconds: float) -> dict[str, Any]:
    """What the server ran over ``seconds`` (by INFO commandstats, and the commands
    clients sent by MONITOR), and the node process's CPU."""
    client = server.client()
    mon = MonitorCounter(server.port)
    try:
        before, cpu0, t0 = commandstats(client), process_tree_cpu(proc.pid), time.time()
        await asyncio.sleep(seconds)
        after, cpu1, t1 = commandstats(client), process_tree_cpu(proc.pid), time.time()
        sent = mon.count(t0, t1)
    finally:
        mon.close()
        client.close()
    delta = calls_delta(before, after)
    wall = t1 - t0
    sent_by = {k: v for k, v in sent["by_command"].items() if k != "info"}  # ours
    return {"seconds": wall, "per_second": sum(delta.values()) / wall,
            "client_per_second": sum(sent_by.values()) / wall, "by_command": delta,
            "client_by_command": sent_by, "cpu_percent": 100 * (cpu1 - cpu0) / wall}


async def failover(server: Server, sizes: Sizes, tmp: Path, shards: int) -> dict[str, Any]:
    """Two nodes share ``shards``; SIGKILL the leader of shard 0: seconds until the other
    leads every shard the killed one led."""
    folder = tmp / f"failover-{shards}"
    rules = _rules(folder, shards)
    r = Redis.from_url(server.url, decode_responses=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["A"] = _node(folder, server, rules, "A")

        async def a_leads() -> bool:
            return all(n == "A" for n in await leaders(r, shards))
        await _until(a_leads, 120, "A leading every shard", 0.2)
        procs["B"] = _node(folder, server, rules, "B")

        async def settled() -> bool:
            led = await leaders(r, shards)
            return None not in led and (shards == 1 or led.count("B") >= shards // 4)
        await _until(settled, 120, "leadership shared by A and B", 0.2)
        await asyncio.sleep(SETTLE)
        led = await leaders(r, shards)
        victim = str(led[0])
        other = "B" if victim == "A" else "A"
        theirs = [i for i, n in enumerate(led) if n == victim]
        t_kill = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)

        async def taken() -> bool:
            now = await leaders(r, shards)
            return all(now[i] == other for i in theirs)
        await _until(taken, 60, f"{other} leading the killed node's shards", 0.01)
        took = time.monotonic() - t_kill
    finally:
        for p in procs.values():
            stop_process(p)
        await r.aclose()
    return {"shards": shards, "takeover_s": took, "moved": len(theirs), "lease_s": LEASE}


BUSY_WINDOW = 20.0  # seconds after a busy start during which the node's own lapses count
BURNERS_PER_CORE = 3  # spinning processes per core: the node gets a fraction of one
AFTER_LOAD = 20.0  # seconds after the load ended before a busy-started node is measured
LAPSE_LINES = ("could not renew its lease", "its lease was dropped", "its lease lapsed")


def _burners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes spinning on a core each: a machine whose cores are all busy."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(n)]


async def busy_start(server: Server, sizes: Sizes, tmp: Path, shards: int,
                     seconds: float = 20.0) -> dict[str, Any]:
    """A node leading ``shards`` started while every core is busy: how often its own node
    lease lapsed in its first ``BUSY_WINDOW`` seconds, then the same node's commands/s
    from ``AFTER_LOAD`` seconds after the load ended."""
    folder = tmp / f"busy-{shards}"
    rules = _rules(folder, shards)
    burners = _burners(BURNERS_PER_CORE * (os.cpu_count() or 2))
    try:
        proc = _node(folder, server, rules, "busy")
        await asyncio.sleep(BUSY_WINDOW)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    try:
        out = (folder / "node-busy.out").read_text(errors="replace")
        lapses = sum(out.count(line) for line in LAPSE_LINES)
        await asyncio.sleep(AFTER_LOAD)
        res = await _window(server, proc, seconds)
    finally:
        stop_process(proc)
    return {"shards": shards, **res, "busy_lapses": lapses, "busy_window_s": BUSY_WINDOW,
            "after_load_s": AFTER_LOAD}


async def write_path(server: Server, sizes: Sizes, shards: int,
                     n: int = 100_000) -> dict[str, Any]:
    """One process touches ``n`` distinct keys spread over ``shards`` and flushes them."""
    keys = [key(i) for i in range(n)]
    client = server.client()
    try:
        async with coalescer(server, False, window="1h", max_wait="2h", shards=shards) as c:
            before = commandstats(client, "usec")
            t0 = time.perf_counter()
            await touch_distinct(c, keys)
            await c.flush()
            dt = time.perf_counter() - t0
            after = commandstats(client, "usec")
    finally:
        client.close()
    usec = sum(calls_delta(before, after).values())
    return {"shards": shards, "write_per_second": n / dt, "redis_us_per_key": usec / n}


def _print(results: list[dict[str, Any]]) -> None:
    for res in results:
        if "write_per_second" in res:
            print(f"write path, {res['shards']:>5} shards: {res['write_per_second']:,.0f} "
                  f"distinct keys/s into Redis, Redis {res['redis_us_per_key']:.2f} us/key")
        elif "takeover_s" in res:
            print(f"failover, {res['shards']:>5} shards ({res['moved']} moved): "
                  f"{res['takeover_s']:.2f} s (lease {res['lease_s']:g} s; target <= "
                  f"{res['lease_s'] + 0.5:g} s)")
        else:
            if "busy_lapses" in res:
                print(f"busy start, {res['shards']:>5} shards: {res['busy_lapses']} lapses of "
                      f"its own lease in its first {res['busy_window_s']:g} s with every core "
                      f"busy (target 0); the same node idle from "
                      f"{res['after_load_s']:g} s after the load (target <= 50/s):")
            top = sorted(res["by_command"].items(), key=lambda kv: -kv[1])[:4]
            print(f"idle node, {res['shards']:>5} shards: {res['per_second']:,.1f} commands/s "
                  f"(server-counted), {res['client_per_second']:,.2f} sent by clients/s, "
                  f"CPU {res['cpu_percent']:.1f} % of a core; top: "
                  + ", ".join(f"{k} {v / res['seconds']:,.1f}/s" for k, v in top))


async def main(shard_counts: list[int], failover_counts: list[int], write_counts: list[int],
               seconds: float, busy_counts: list[int]) -> None:
    sizes = Sizes()
    results = []
    with tempfile.TemporaryDirectory(prefix="coalescer-idle-") as tmp_name:
        tmp = Path(tmp_name)
        for n in busy_counts:
            with Server(tmp, f"busy-{n}") as server:
                results.append(await busy_start(server, sizes, tmp, n, seconds))
            _print(results[-1:])
        for n in shard_counts:
            with Server(tmp, f"idle-{n}") as server:
                results.append(await idle(server, sizes, tmp, n, seconds))
            _print(results[-1:])
        for n in failover_counts:
            with Server(tmp, f"failover-{n}") as server:
                results.append(await failover(server, sizes, tmp, n))
            _print(results[-1:])
        for n in write_counts:
            with Server(tmp, f"write-{n}") as server:
                results.append(await write_path(server, sizes, n))
            _print(results[-1:])


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shards", default=",".join(map(str, SHARD_COUNTS)))
    parser.add_argument("--failover", default=",".join(map(str, FAILOVER_COUNTS)))
    parser.add_argument("--write", default=",".join(map(str, WRITE_COUNTS)))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--busy", default="", help="shard counts of a node started while "
                        "every core is busy (e.g. 4096)")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    asyncio.run(main(_counts(args.shards), _counts(args.failover), _counts(args.write),
                     args.seconds, _counts(args.busy)))
