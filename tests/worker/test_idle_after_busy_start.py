"""A node started on a busy machine returns to an idle node's cost once the load ends.

Spinning processes load every core for a bounded time while a node with 4,096 shards
starts (its lease renewals, shard acquisitions and pollers all compete for the CPU, and
its own lease may lapse meanwhile). Once they have exited and the server's clock says
20 s have passed, the server's command counts (``INFO commandstats``, commands run
inside scripts included) are read over four of the node's lease renewals (about 9 s at
the default lease): per renewal, and per second of the server's clock, so that neither
extra commands nor renewals that stayed frequent after the load go unseen. Just after
the load, a node that took shards late still makes their first claims: a few seconds
of catching up, not an idle node's cost.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from tests.helpers.e2e import recorder_rules
from tests.helpers.leases import PROBE, calls, renewals
from tests.helpers.servers import ValkeyProcess, wait_until

pytestmark = pytest.mark.slow

SHARDS = 4096
SPIN_SECONDS = 15  # how long each spinning process runs (it exits by itself)
SPINNERS_PER_CORE = 3
LEASE = 3.0  # the default leader_lease: a renewal every three quarters of it
PER_SECOND = 50  # an idle node's commands per second, at most
PER_RENEWAL = int(PER_SECOND * LEASE * 0.75)  # the same, per lease renewal (112)
SETTLE = 20.0  # seconds of the server's clock after the load ended, before the window
WINDOW = 4  # renewals counted

RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: {mod}:refresh
"""

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def server_seconds(client: Any) -> float:
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


def spinners() -> list[subprocess.Popen[bytes]]:
    """Processes that keep every core busy for ``SPIN_SECONDS``, then exit."""
    n = SPINNERS_PER_CORE * (os.cpu_count() or 2)
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(s=SPIN_SECONDS)],
                             stdin=subprocess.DEVNULL) for _ in range(n)]


async def test_a_node_started_while_every_core_is_busy_is_idle_again_once_the_load_ends(
        own_server: ValkeyProcess, namespace: str, tmp_path: Path) -> None:
    path, _ = recorder_rules(tmp_path, f"busy_{namespace}",
                             RULES.format(ns=namespace, shards=SHARDS, mod="{mod}"))
    client = own_server.client()
    load = spinners()
    try:
        async with Coalescer.from_yaml(path, redis_url=own_server.url,
                                       node_id="busy") as node:
            for proc in load:
                await asyncio.to_thread(proc.wait)
            settled = server_seconds(client) + SETTLE
            await wait_until(lambda: server_seconds(client) >= settled, timeout=2 * SETTLE,
                             interval=0.5, message="20 s of the server's clock")
            before, began = calls(client), server_seconds(client)
            await renewals(node.redis, namespace, "busy", WINDOW)
            after, ended = calls(client), server_seconds(client)
            assert len(node.leads()) == SHARDS
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
        client.close()
    delta = {name: n - before.get(name, 0) for name, n in after.items()
             if name not in (PROBE, "info")}
    top = sorted(delta.items(), key=lambda kv: -kv[1])[:8]
    # an idle node's renewals cost about eight commands each: nothing per shard, and
    # renewals at the idle cadence (counted against the server's clock: a cadence that
    # stayed tight would keep the commands per renewal low and the rate high)
    assert sum(delta.values()) <= WINDOW * PER_RENEWAL, top
    assert sum(delta.values()) <= PER_SECOND * (ended - began), (top, ended - began)
