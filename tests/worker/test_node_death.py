"""A node's death ends its sync handlers' runs: SIGKILL a `coalescer run` node while
its plain-function handlers run (by default in its child processes) and every child,
and the fork server they come from, is gone, none left behind, before the standby
runs the keys again; no key runs twice at once.

The handler writes "NODE PID PPID KEY TOKEN TIME" every 20 ms while it runs, until a
release file exists: what the test reads.
"""

from __future__ import annotations

import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import NodeProcs, leader_node, settled
from tests.helpers.servers import wait_until

KEYS = [f"item:{i}" for i in range(10)]

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 4s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 60s
  concurrency: 16
  retry: {{attempts: 5, backoff: 50ms, max_backoff: 200ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {mod}:refresh
"""

HANDLER = """\
import os
import pathlib
import time

HERE = pathlib.Path(__file__).parent


def refresh(claim):
    # a plain function: it says it is alive every 20 ms until released
    node = os.environ["E2E_NODE"]
    with open(HERE / "runs.log", "a") as log:
        while not (HERE / "release").exists():
            log.write(f"{node} {os.getpid()} {os.getppid()} {claim.key} {claim.token} "
                      f"{time.time()}\\n")
            log.flush()
            time.sleep(0.02)
"""

Line = tuple[str, int, int, str, int, float]


def runs(folder: Path) -> list[Line]:
    path = folder / "runs.log"
    found: list[Line] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 6:  # not a line a killed child left half-written
            found.append((parts[0], int(parts[1]), int(parts[2]), parts[3], int(parts[4]),
                          float(parts[5])))
    return found


def keys_run_by(folder: Path, node: str) -> set[str]:
    return {line[3] for line in runs(folder) if line[0] == node}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeProcs]:
    procs = NodeProcs(tmp_path)
    yield procs
    procs.stop_all()


@pytest.mark.slow
async def test_a_sigkilled_node_takes_its_running_sync_handlers_with_it(
        tmp_path: Path, nodes: NodeProcs, namespace: str, redis_url: str,
        redis_client: Any) -> None:
    module = f"dying_{namespace.replace('-', '_').replace(':', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(HANDLER))
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace, mod=module))
    shard = KeySpace(namespace, 1).shard(0)

    a = nodes.start(rules, redis_url, "A")
    await wait_until(lambda: _leads(redis_client, shard.leader, "A"), timeout=20,
                     message=f"node A leading; its log:\n{nodes.log('A')}")
    nodes.start(rules, redis_url, "B")
    await wait_until(lambda: redis_client.zscore(shard.nodes, "B"), timeout=20,
                     message=f"node B standing by; its log:\n{nodes.log('B')}")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as writer:
        for key in KEYS:
            writer.touch(key)
        await writer.flush()
        await wait_until(lambda: keys_run_by(tmp_path, "A") == set(KEYS), timeout=30,
                         message="A runs every key")
        a_lines = [line for line in runs(tmp_path) if line[0] == "A"]
        children = {line[1] for line in a_lines}
        fork_servers = {line[2] for line in a_lines}
        # the runs share child processes, up to 8 runs each: 2 for concurrency 16
        assert len(children) == 2
        assert a.pid not in children | fork_servers

        a.send_signal(signal.SIGKILL)
        assert a.wait() == -signal.SIGKILL
        # gone within less than the claim lease: before B may claim the keys
        await wait_until(lambda: not any(alive(pid) for pid in children | fork_servers),
                         timeout=4, message="A's child processes and fork server gone")
        await wait_until(lambda: keys_run_by(tmp_path, "B") == set(KEYS), timeout=30,
                         message="B runs every key again")
        for key in KEYS:
            a_last = max(line[5] for line in runs(tmp_path) if line[3] == key
                         and line[0] == "A")
            b_first = min(line[5] for line in runs(tmp_path) if line[3] == key
                          and line[0] == "B")
            assert a_last < b_first, f"{key}: A's run was alive after B's began"
        (tmp_path / "release").write_text("")
        await wait_until(lambda: settled(redis_client, namespace), timeout=30,
                         message="every key refreshed")


async def _leads(redis: Any, leader_key: str, node: str) -> bool:
    return leader_node(await redis.get(leader_key)) == node
