"""Random touch traces of one key of an ``edge: leading`` rule through a real node (its
writer, poller, handler and acks, on the server clock), against the reference model.

A real node claims a due key a little late (its poller's lag) and a touch reaches Redis
a little after ``touch()``; the model's partition of the touches into refreshes
depends on neither as long as no touch comes within that slack of a decision (a due
time, the end of a window). So each trace is first played on the model with every lag
from 0 to ``SLACK_MS`` and with its touches shifted by up to ``SLACK_MS``; only a trace
whose partition is the same under all of them is run, and the node must give exactly
that partition (which items each refresh got, in order). Slow: each trace takes seconds
of real time. ``LEADING_NODE_TRACES`` sets how many (8 by default)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Start
from tests.helpers.debounce_model import LeadingKey
from tests.helpers.e2e import recorder_rules, settled
from tests.helpers.servers import wait_until

pytestmark = pytest.mark.slow

WINDOW_MS, MAX_WAIT_MS = 300, 700
SLACK_MS = 120  # a poller's lag and a touch's delay this machine may show, at most
GAPS_MS = (200, 250, 1000)  # within a window, or past it; each far from the slack

RULES = f"""\
namespace: {{ns}}
claim_lease: 3s
defaults:
  absorb: 0s
rules:
  - name: lead
    match: "lead:{{{{id}}}}"
    window: {WINDOW_MS}ms
    max_wait: {MAX_WAIT_MS}ms
    edge: leading
    items: {{{{max: 1000}}}}
    handler: {{{{mod}}}}:refresh
"""


def partition(times: list[int], lag: int) -> list[tuple[str, ...]]:
    """The model's refreshes (their touches) when each is claimed ``lag`` after it is
    due and takes no time (a touch at the instant of a claim comes first)."""
    key = LeadingKey(WINDOW_MS, MAX_WAIT_MS)
    touches = [(t, f"t{n}") for n, t in enumerate(times)]
    while touches or key.due is not None:
        due = key.next_due()
        if due is not None and (not touches or due + lag < touches[0][0]):
            key.poll(due + lag)
            key.finish()
        else:
            key.touch(*touches.pop(0))
    return [run.labels for run in key.runs]


def robust_trace(rng: random.Random) -> tuple[list[int], list[tuple[str, ...]]]:
    """Touch times (ms from the start) whose partition no lag or delay up to SLACK_MS
    changes, and that partition."""
    while True:
        times, t = [], 0
        for _ in range(rng.randint(2, 7)):
            t += rng.choice(GAPS_MS)
            times.append(t)
        expected = partition(times, 0)
        variants = [partition(times, lag) for lag in (SLACK_MS // 2, SLACK_MS)]
        for shift in (1, 2):
            moved = [x + (SLACK_MS if n % 2 == shift % 2 else 0) for n, x in enumerate(times)]
            variants.append(partition(moved, 0))
        if all(v == expected for v in variants):
            return times, expected


async def test_random_traces_through_a_node_match_the_model(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = recorder_rules(tmp_path, f"leadnode_{namespace}", RULES.format(ns=namespace))
    c = await start(path, redis_url=redis_url, node_id="n1")
    rng = random.Random(int(os.environ.get("LEADING_SEED", "5")))
    failures = []
    for n in range(int(os.environ.get("LEADING_NODE_TRACES", "8"))):
        times, expected = robust_trace(rng)
        key = f"lead:{n}"
        t0 = time.monotonic()
        for i, at in enumerate(times):
            await asyncio.sleep(max(0.0, t0 + at / 1000 - time.monotonic()))
            c.touch(key, item=f"t{i}")
            await c.flush()
        await wait_until(lambda: settled(redis_client, namespace), timeout=10,
                         message=f"{key} refreshed")
        got = [tuple(sorted(claim.items, key=lambda x: int(x[1:]))) for claim in rec.of(key)]
        if got != expected:
            failures.append(f"{key}: touches at {times} ms: node {got}, model {expected}")
    assert failures == []
