"""The ``fair_cap`` group: ``max_running: N`` over ``NODES`` ``coalescer run`` processes,
counted from outside.

Each process runs the handler ``run``: it appends ``S TIME TENANT`` when a run starts
and ``E TIME TENANT`` when it ends (after a random sleep of up to ``WORK`` seconds), to
``$BENCH_REFRESH_LOG.PID``. The node acks a run only after its handler returned, so
under the cap every tenant's runs, merged over the processes by time, never number
more than the cap at once. A *moment over the cap* is a start that takes a tenant's
count of running runs above the cap (an end and a start at the same microsecond are
taken end first). The same run with ``fair`` off (no cap) is the baseline column: it
shows what the count finds where nothing caps the runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

from coalescer import Coalescer, Config
from coalescer.store.connection import connect
from coalescer.store.keys import KeySpace

from . import common as C
from . import fairness as FR
from .valkey import Server

CAP = 2
NODES = 3
SHARDS = 6  # two a node: the cap holds across shards and nodes
TENANTS = 8
WORK = 0.003  # seconds a run sleeps, at most
CONCURRENCY = 16  # per node: far more slots than the cap
NS = "faircap"
WAIT = 420.0  # seconds for every run to end (the group may take 600 s in all)

_LOG: dict[str, TextIO] = {}


def _log() -> TextIO:
    log = _LOG.get("file")
    if log is None:
        path = f"{os.environ['BENCH_REFRESH_LOG']}.{os.getpid()}"
        log = _LOG["file"] = open(path, "a", buffering=1)  # noqa: SIM115
    return log


async def run(claim: Any) -> None:
    """The handler: a start line, up to ``WORK`` seconds asleep, an end line."""
    log = _log()
    org = claim.params["org"]
    log.write(f"S {time.time():.6f} {org}\n")
    await asyncio.sleep(random.uniform(0, WORK))
    log.write(f"E {time.time():.6f} {org}\n")


def rules(fair: bool) -> str:
    text = FR.tenant_rules(FR.fair_block(max_running=CAP) if fair else "",
                           handler="bench.fairness_cap:run", concurrency=CONCURRENCY,
                           namespace=NS)
    return text.replace("shards: 1\n", f"shards: {SHARDS}\n")


def read_events(log: Path) -> list[tuple[float, int, str]]:
    """(time, 0 for an end / 1 for a start, tenant) of every process's complete lines."""
    out: list[tuple[float, int, str]] = []
    for path in sorted(log.parent.glob(f"{log.name}.*")):
        with path.open() as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and line.endswith("\n"):
                    out.append((float(parts[1]), 0 if parts[0] == "E" else 1, parts[2]))
    return out


def over_cap(events: list[tuple[float, int, str]], cap: int) -> dict[str, Any]:
    """Moments over the cap, and the most runs of one tenant seen at once."""
    running: dict[str, int] = defaultdict(int)
    moments, most = 0, 0
    for _, kind, org in sorted(events):
        running[org] += 1 if kind else -1
        if kind and running[org] > cap:
            moments += 1
        most = max(most, running[org])
    starts = sum(kind for _, kind, _ in events)
    return {"starts": starts, "ends": len(events) - starts, "over_cap_moments": moments,
            "max_running_seen": most}


async def cap(server: Server, sizes: C.Sizes, tmp: Path, fair: bool) -> dict[str, Any]:
    text = rules(fair)
    if fair and (why := FR.fair_refused(text)):
        return {"skipped": why}
    n = FR.sizes_of(sizes).cap_claims
    folder = tmp / f"fair-cap-{time.time_ns()}"
    folder.mkdir(parents=True)
    rules_path = folder / "rules.yaml"
    rules_path.write_text(text)
    log = folder / "runs.log"
    exe = str(Path(sys.executable).parent / "coalescer")
    procs = [C.spawn([exe, "run", "--quiet", "--rules", str(rules_path), "--redis", server.url,
                      "--http", "off", "--node-id", f"cap{i}", "--grace", "5"], log,
                     folder / f"node-{i}.out") for i in range(NODES)]
    conn = await connect(server.url)
    try:
        leads = await C.wait_led(conn.client, KeySpace(NS, SHARDS), NODES)
        keys = [FR.tkey(f"c{j}", i) for i in range(n // TENANTS) for j in range(TENANTS)]
        config = Config.from_string(text, source="<bench>", import_handlers=False)
        t0 = time.time()
        async with Coalescer(config, redis_url=server.url, worker=False) as w:
            await C.touch_distinct(w, keys)
            await w.flush()
        try:
            await C.wait_for(lambda: _ended(log, len(keys)), WAIT, f"{len(keys)} runs ended")
            complete = True
        except RuntimeError:  # a loaded machine: the runs made so far are counted
            complete = False
        seconds = time.time() - t0
    finally:
        await conn.close()
        for proc in procs:
            C.stop_process(proc)
    out = over_cap(read_events(log), CAP)
    out.update(fair=fair, complete=complete, cap=CAP, nodes=NODES, shards=SHARDS, tenants=TENANTS,
               claims=len(keys), seconds=seconds, leads=leads,
               load_average=list(os.getloadavg()))
    return out


def _ended(log: Path, n: int) -> bool:
    ends = 0
    for path in log.parent.glob(f"{log.name}.*"):
        with path.open() as f:
            ends += sum(1 for line in f if line.startswith("E "))
    return ends >= n
