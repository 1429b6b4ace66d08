"""Sync (plain ``def``) handlers: the node's process pool (the default) against
``isolation: thread``, side by side in one run.

    .venv/bin/python -m bench.sync_pool [--keys N] [--repeats R] [--rules 4]
                                        [--concurrency 16]

Drain: a fresh valkey-server; a node in this process (``Coalescer``, worker on) whose
one rule's handler is a no-op plain function; N keys (20,000) touched and flushed,
then the clock runs over ``drain()`` (the node's runner runs them: the pool, or the
rule's threads). keys/s = N / that time. Each of the R rounds (3) measures the pool
then threads; the table gives each round's figures and the ratio of the medians.

Memory: a ``coalescer run`` process per mode, with ``--rules`` rules (4) at
``--concurrency`` (16) whose handler sleeps (``time.sleep``, as a handler waiting on
its database does) until released; ``rules x concurrency`` keys touched, and once every
run has started, the PSS (``/proc/PID/smaps_rollup``) of the node and every process
under it (fork server, children, resource tracker) is summed. Ratio: pool / threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from coalescer import Coalescer

from .valkey import Server

HANDLERS = """\
import os
import pathlib
import time

HERE = pathlib.Path(__file__).parent


def noop(claim):
    return None


def sleepy(claim):
    (HERE / "running" / f"{claim.key.replace(':', '_')}").write_text(str(os.getpid()))
    while not (HERE / "release").exists():
        time.sleep(0.05)
"""


def _rules(namespace: str, rules: int, concurrency: int, handler: str, thread: bool) -> str:
    lines = [f"namespace: {namespace}", "defaults:", "  window: 10ms", "  absorb: 5ms",
             "  timeout: 5m", f"  concurrency: {concurrency}", "rules:"]
    for i in range(rules):
        lines += [f"  - name: r{i}", f'    match: "r{i}:{{id}}"',
                  f"    handler: pool_handlers:{handler}"]
        if thread:
            lines.append("    isolation: thread")
    return "\n".join(lines) + "\n"


def _folder(root: Path, name: str) -> Path:
    folder = root / name
    (folder / "running").mkdir(parents=True)
    (folder / "pool_handlers.py").write_text(textwrap.dedent(HANDLERS))
    return folder


async def _drain_rate(root: Path, url: str, keys: int, thread: bool, label: str) -> float:
    folder = _folder(root, label)
    path = folder / "rules.yaml"
    path.write_text(_rules(label, 1, 16, "noop", thread))
    async with Coalescer.from_yaml(path, redis_url=url) as c:
        await c.drain()  # the pool's first children started
        c.touch("r0:warm")
        await c.drain()
        for i in range(keys):
            c.touch(f"r0:{i}")
        await c.flush()
        began = time.perf_counter()
        await c.drain(timeout=600)
        took = time.perf_counter() - began
    return keys / took


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _memory(root: Path, url: str, rules: int, concurrency: int, *, thread: bool,
            label: str) -> tuple[int, int]:
    """(PSS summed in kB, processes) of a node with every run started."""
    folder = _folder(root, label)
    path = folder / "rules.yaml"
    path.write_text(_rules(label, rules, concurrency, "sleepy", thread))
    node = subprocess.Popen([sys.executable, "-m", "coalescer.cli", "run", "--rules",
                             str(path), "--redis", url, "--http", "off"], cwd=folder,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(_touch(path, url, rules, concurrency))
        wanted = rules * concurrency
        deadline = time.monotonic() + 120
        while len(os.listdir(folder / "running")) < wanted:
            if time.monotonic() > deadline:
                raise SystemExit(f"{label}: only {len(os.listdir(folder / 'running'))} of "
                                 f"{wanted} runs started")
            time.sleep(0.1)
        time.sleep(1.0)  # the runs settle into their sleep
        pids = _descendants(node.pid)
        return sum(_pss_kb(pid) for pid in pids), len(pids)
    finally:
        (folder / "release").write_text("")
        node.terminate()
        node.wait(60)


async def _touch(path: Path, url: str, rules: int, concurrency: int) -> None:
    async with Coalescer.from_yaml(path, redis_url=url, worker=False) as writer:
        for i in range(rules):
            for j in range(concurrency):
                writer.touch(f"r{i}:{j}")
        await writer.flush()


def main(keys: int, repeats: int, rules: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, Server(Path(tmp)) as server:
        root = Path(tmp)
        pool_rates, thread_rates = [], []
        print(f"drain of {keys:,} keys, no-op sync handler (keys/s)")
        for r in range(repeats):
            pool = asyncio.run(_drain_rate(root, server.url, keys, False, f"dp{r}"))
            threads = asyncio.run(_drain_rate(root, server.url, keys, True, f"dt{r}"))
            pool_rates.append(pool)
            thread_rates.append(threads)
            print(f"  round {r + 1}: pool {pool:,.0f}  threads {threads:,.0f}  "
                  f"ratio {pool / threads:.2f}x")
        ratio = statistics.median(pool_rates) / statistics.median(thread_rates)
        print(f"  median: pool {statistics.median(pool_rates):,.0f}  threads "
              f"{statistics.median(thread_rates):,.0f}  ratio {ratio:.2f}x (target >= 1.0x)")
        print(f"PSS with {rules} rules x concurrency {concurrency} "
              f"({rules * concurrency} sleeping runs)")
        pss_pool, n_pool = _memory(root, server.url, rules, concurrency, thread=False,
                                     label="mp")
        pss_threads, n_threads = _memory(root, server.url, rules, concurrency, thread=True,
                                           label="mt")
        print(f"  pool: {pss_pool / 1024:.1f} MB over {n_pool} processes "
              f"({(pss_pool / max(n_pool - 1, 1)) / 1024:.2f} MB a process on average)")
        print(f"  threads: {pss_threads / 1024:.1f} MB over {n_threads} processes")
        print(f"  ratio {pss_pool / pss_threads:.2f}x (target <= 3x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rules", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    main(args.keys, args.repeats, args.rules, args.concurrency)
