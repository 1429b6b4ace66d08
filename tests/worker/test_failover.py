"""Failover with real processes: `coalescer run` nodes, SIGKILL and SIGTERM.

Each node is a child process `python -m coalescer.cli run ... --http off`; its
handler writes "PHASE NODE KEY TOKEN ATTEMPT" lines to a shared file, which is
what the tests read.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import NodeProcs, leader_node, line_rules, read_lines, settled
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 1s
defaults:
  window: 100ms
  max_wait: 2s
  absorb: 10ms
  timeout: 30s
  retry: {{attempts: 3, backoff: 50ms, max_backoff: 200ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeProcs]:
    procs = NodeProcs(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def setup(tmp_path: Path, namespace: str) -> tuple[Path, Path]:
    """(rules path, the handlers' line log)."""
    rules = line_rules(tmp_path, f"lines_{namespace}", RULES.format(ns=namespace))
    return rules, tmp_path / "refreshes.log"


@pytest_asyncio.fixture
async def toucher(setup: tuple[Path, Path], redis_url: str) -> AsyncIterator[Coalescer]:
    """A write-path-only coalescer (worker=False) on the same rules."""
    async with Coalescer.from_yaml(setup[0], redis_url=redis_url, worker=False) as c:
        yield c


async def leader_is(r: Any, namespace: str, node: str | None) -> bool:
    return leader_node(await r.get(KeySpace(namespace, 1).shard(0).leader)) == node


async def standing_by(r: Any, namespace: str, node: str) -> bool:
    return await r.zscore(KeySpace(namespace, 1).shard(0).nodes, node) is not None


def lines(log: Path, phase: str, key: str, node: str | None = None) -> list[tuple[Any, ...]]:
    return [entry for entry in read_lines(log)
            if entry[0] == phase and entry[2] == key and (node is None or entry[1] == node)]


@dataclass
class World:
    """One test's rules, line log, node processes, toucher and Redis client."""

    rules: Path
    log: Path
    nodes: NodeProcs
    toucher: Coalescer
    redis_url: str
    r: Any
    namespace: str

    async def settled(self) -> bool:
        return await settled(self.r, self.namespace)

    async def start_pair(self, **a_env: str,
                         ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        """Node A (the leader), then node B (standing by)."""
        nodes, r, ns = self.nodes, self.r, self.namespace
        a = nodes.start(self.rules, self.redis_url, "A", E2E_LOG=str(self.log), **a_env)
        await wait_until(lambda: leader_is(r, ns, "A"), timeout=20,
                         message=f"node A leading; its log:\n{nodes.log('A')}")
        b = nodes.start(self.rules, self.redis_url, "B", E2E_LOG=str(self.log))
        await wait_until(lambda: standing_by(r, ns, "B"), timeout=20,
                         message=f"node B standing by; its log:\n{nodes.log('B')}")
        return a, b


@pytest.fixture
def world(setup: tuple[Path, Path], nodes: NodeProcs, toucher: Coalescer, redis_client: Any,
          namespace: str) -> World:
    url = toucher.redis_url
    assert url is not None
    return World(setup[0], setup[1], nodes, toucher, url, redis_client, namespace)


async def test_sigkill_of_the_leader_lets_the_standby_take_over(world: World) -> None:
    w = world
    a, _ = await w.start_pair()
    w.toucher.touch("item:1")
    await w.toucher.flush()
    await wait_until(lambda: lines(w.log, "done", "item:1", "A"), message="A refreshes item:1")
    # and records it (killed before its ack, A's refresh would rightly run again)
    await wait_until(w.settled, message="A's ack recorded")

    a.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    await wait_until(lambda: leader_is(w.r, w.namespace, "B"), timeout=10,
                     message=f"B taking over; its log:\n{w.nodes.log('B')}")
    took = time.monotonic() - killed
    print(f"\nleader SIGKILL -> standby leading: {took:.2f}s (leader_lease 1s)")
    assert a.wait() == -signal.SIGKILL

    w.toucher.touch("item:2")
    await w.toucher.flush()
    await wait_until(lambda: lines(w.log, "done", "item:2", "B"), timeout=10,
                     message="B refreshes item:2")
    await wait_until(w.settled)
    assert [e[1] for e in read_lines(w.log) if e[0] == "done"] == ["A", "B"]


async def test_sigkill_during_a_refresh_reruns_it_with_a_larger_token(world: World) -> None:
    w = world
    # A's handler blocks forever on a first attempt (its gate file never appears)
    a, _ = await w.start_pair(E2E_BLOCK="first")
    w.toucher.touch("item:1")
    await w.toucher.flush()
    (started,) = await wait_until(lambda: lines(w.log, "start", "item:1", "A"),
                                  message="A starts refreshing item:1")
    a.send_signal(signal.SIGKILL)
    a.wait()

    (rerun,) = await wait_until(lambda: lines(w.log, "done", "item:1", "B"), timeout=15,
                                message=f"B re-running item:1; its log:\n{w.nodes.log('B')}")
    _, _, _, token, attempt = started
    assert attempt == 1
    assert rerun[3] > token
    assert rerun[4] == 2
    await wait_until(w.settled)
    assert lines(w.log, "done", "item:1", "A") == []


async def test_sigterm_drains_a_running_refresh_and_releases_the_lease(
        world: World, tmp_path: Path) -> None:
    w = world
    gate = tmp_path / "gate"
    a, b = await w.start_pair(E2E_BLOCK="gate", E2E_GATE=str(gate))
    w.toucher.touch("item:1")
    await w.toucher.flush()
    await wait_until(lambda: lines(w.log, "start", "item:1", "A"), message="A refreshing")

    a.send_signal(signal.SIGTERM)
    # the lease is released at once, so B leads while A still drains its refresh
    await wait_until(lambda: leader_is(w.r, w.namespace, "B"), timeout=10,
                     message="B leading after A's SIGTERM")
    assert a.poll() is None, "A exited before its running refresh finished"
    gate.touch()
    assert a.wait(timeout=20) == 0, w.nodes.log("A")

    (done,) = lines(w.log, "done", "item:1", "A")
    assert done[4] == 1
    await wait_until(w.settled, message="A's ack recorded (nothing pending or in flight)")
    assert lines(w.log, "start", "item:1", "B") == []  # acked, so never re-run
    assert b.poll() is None
