"""The TypeScript client (clients/node) against BullMQ's ``addBulk``, side by side.

    .venv/bin/python -m bench.node_client [--keys N] [--repeats R]

Each round starts a fresh valkey-server and, one after the other on it, runs
``bench/bullmq/node_client.mjs`` twice in a Node process of its own: N distinct keys
touched with the Node client (one ``touch()`` a key, then ``flush()``: keys/s until Redis
holds them all), and the same N keys added as BullMQ jobs with ``Queue.addBulk`` (1,000 a
call, 4 calls in flight, the debouncing options of ``bullmq/peer.mjs``: jobs/s). It
prints both, and their ratio in that round, min / median / max over the rounds, and the
load average (the figures move with the machine's load; the ratio is the claim). The
first run builds the client (``npm ci && npm run build`` in clients/node) and installs
bench/bullmq's packages (``npm install``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.peers import BULLMQ_DIR, bullmq_unavailable
from bench.valkey import Server

CLIENT_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"
SCRIPT = BULLMQ_DIR / "node_client.mjs"
TIMEOUT = 600.0
TARGET_PER_SECOND = 100_000
TARGET_RATIO = 2.0


def build_client() -> None:
    """npm ci and npm run build in clients/node (once per checkout state)."""
    if shutil.which("npm") is None:
        raise SystemExit("node_client: npm not found on PATH")
    for command in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
        done = subprocess.run(command, cwd=CLIENT_DIR, capture_output=True, text=True,
                              timeout=TIMEOUT, check=False)
        if done.returncode != 0:
            raise SystemExit(f"node_client: {' '.join(command)} failed in {CLIENT_DIR}:\n"
                             f"{done.stderr[-2000:]}")


def measure(workload: str, url: str, keys: int) -> dict[str, Any]:
    request = json.dumps({"workload": workload, "url": url, "keys": keys})
    done = subprocess.run(["node", str(SCRIPT), request], cwd=BULLMQ_DIR, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"node_client {workload} exited {done.returncode}: "
                           f"{done.stderr.strip()[-500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["redis_holds"] != keys:
        raise RuntimeError(f"node_client {workload}: Redis holds {result['redis_holds']} of "
                           f"{keys} keys")
    return result


def one_round(keys: int) -> tuple[dict[str, Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root, Server(Path(root)) as server:
        client = measure("coalescer", server.url, keys)
        server.client().flushall()
        bullmq = measure("bullmq", server.url, keys)
    return client, bullmq


def spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values),
                                              max(values)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.node_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=200_000, help="distinct keys a run (200,000)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (3)")
    args = p.parse_args(argv)
    if (why := bullmq_unavailable()) is not None:
        print(f"node_client: BullMQ cannot run here: {why}", file=sys.stderr)
        return 1
    build_client()
    rounds = [one_round(args.keys) for _ in range(args.repeats)]
    clients = [float(c["per_second"]) for c, _ in rounds]
    peers = [float(b["per_second"]) for _, b in rounds]
    ratios = [c / b for c, b in zip(clients, peers, strict=True)]

    def cpu(side: int, field: str) -> str:
        return f"{statistics.median(float(r[side][field]) for r in rounds):.1f}"

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.keys:,} distinct keys, {args.repeats} rounds (min / median / max), "
          f"load average {load}")
    print("| figure | measured | target |")
    print("| --- | --- | --- |")
    print(f"| Node client, distinct touches/s into Redis, one process | {spread(clients)} "
          f"| >= {TARGET_PER_SECOND:,} |")
    print(f"| BullMQ addBulk, jobs/s, same server and run | {spread(peers)} | - |")
    print(f"| Node client over BullMQ addBulk, each round | {spread(ratios, '{:.1f}x')} "
          f"| >= {TARGET_RATIO:g}x |")
    print(f"| Node client: CPU µs a key (median), its process / Redis | "
          f"{cpu(0, 'client_cpu_us')} / {cpu(0, 'redis_cpu_us')} | - |")
    print(f"| BullMQ addBulk: CPU µs a job (median), its process / Redis | "
          f"{cpu(1, 'client_cpu_us')} / "
          f"{cpu(1, 'redis_cpu_us')} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
