"""Keys scheduled far ahead, many of them: a year-ahead schedule costs what a pending key
costs in Redis, and a leader killed while they wait loses none of the keys falling due.
(The figures at 10,000,000 keys come from ``python -m bench.schedules_10m``.)"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import cast

import pytest

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import NodeProcs, leader_node, line_rules, read_lines
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 1h
  max_wait: 2h
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""
DAY = 86_400.0
WAITING = 50_000


def _used_memory(server: ValkeyProcess) -> int:
    client = server.client()
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


async def _bytes_per_key(c: Coalescer, server: ValkeyProcess, prefix: str,
                         at: list[float] | None) -> float:
    before = _used_memory(server)
    for i in range(WAITING):
        if at is None:
            c.touch(f"item:{prefix}{i}")
        else:
            c.touch(f"item:{prefix}{i}", at=at[i])
        if i % 5_000 == 4_999:
            await c.flush()
    await c.flush()
    return (_used_memory(server) - before) / WAITING


async def test_a_key_scheduled_a_year_ahead_costs_what_a_pending_key_costs(
        own_server: ValkeyProcess, tmp_path: Path, namespace: str) -> None:
    path = line_rules(tmp_path, f"lines_{namespace}", RULES.format(ns=namespace))
    rng = random.Random(365)
    now = time.time()
    at = [now + rng.uniform(3600.0, 365 * DAY) for _ in range(WAITING)]
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as c:
        c.touch("item:warm-up", at=now + DAY)  # scripts loaded, shard keys made
        await c.flush()
        scheduled = await _bytes_per_key(c, own_server, "s", at)
        pending = await _bytes_per_key(c, own_server, "p", None)
    assert scheduled <= 150, f"{scheduled:.1f} B per scheduled key"
    assert scheduled <= pending * 1.05, f"scheduled {scheduled:.1f} B, pending {pending:.1f} B"


@pytest.mark.slow
async def test_a_leader_killed_while_a_year_of_schedules_waits_loses_nothing(
        own_server: ValkeyProcess, tmp_path: Path, namespace: str) -> None:
    rules = line_rules(tmp_path, f"lines_{namespace}", RULES.format(ns=namespace))
    log = tmp_path / "refreshes.log"
    nodes = NodeProcs(tmp_path)
    shard = KeySpace(namespace, 1).shard(0)
    r = own_server.client()
    rng = random.Random(7)
    try:
        async with Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False) as c:
            now = time.time()
            for i in range(WAITING):
                c.touch(f"item:far-{i}", at=now + rng.uniform(3600.0, 365 * DAY))
            await c.flush()
            a = nodes.start(rules, own_server.url, "A", E2E_LOG=str(log))
            await wait_until(lambda: leader_node(cast("str | None", r.get(shard.leader))) == "A",
                             timeout=20, message=f"A leading; its log:\n{nodes.log('A')}")
            nodes.start(rules, own_server.url, "B", E2E_LOG=str(log))
            await wait_until(lambda: r.zscore(shard.nodes, "B") is not None, timeout=20,
                             message="B standing by")
            first = time.time() + 1.0
            falling = [f"item:soon-{i}" for i in range(1_000)]  # 500 a second for 2 s
            for i, key in enumerate(falling):
                c.touch(key, at=first + i / 500)
            await c.flush()
        await wait_until(lambda: any(e[1] == "A" and e[0] == "done" for e in read_lines(log)),
                         timeout=10, message="A refreshing the keys falling due")
        a.send_signal(signal.SIGKILL)
        a.wait()
        done = Counter[str]()

        def all_done() -> bool:
            done.clear()
            done.update(e[2] for e in read_lines(log) if e[0] == "done")
            return all(done[k] for k in falling)

        await wait_until(all_done, timeout=30,
                         message=f"every key refreshed; B's log:\n{nodes.log('B')}")
        assert r.zcard(shard.due("item")) == WAITING  # none of the far keys ran early
        assert not any(k.startswith("item:far-") for k in done)
        tokens: dict[str, list[int]] = {}
        for phase, _node, key, token, _ in read_lines(log):
            if phase == "start":
                tokens.setdefault(key, []).append(token)
        assert all(t == sorted(set(t)) for t in tokens.values())  # a re-run's token is larger
    finally:
        nodes.stop_all()
        r.close()
