"""`coalescer demo`: a bulk import's burst of touches, coalesced, on the embedded server.

Each run works in a namespace of its own (``demo-`` and random hex digits) and deletes
its keys afterwards, so earlier runs, or other keys on the same server, never change
what it reports: every number comes from this run alone.

Without ``--rules`` it runs the rules and handlers shipped in ``demo_app/``, with the
embedded server's folder found from the working folder (the nearest ``.coalescer/``
in it or above, else a new ``./.coalescer/``), so it works in any folder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from coalescer.coalescer import Coalescer
from coalescer.common.redact import redact
from coalescer.config.rules import Config
from coalescer.config.rules_source import load_rules
from coalescer.store.embedded import project_root
from coalescer.store.keys import namespace_glob

USERS = 50
HOT_TOUCHES = 10_000
DEMO_SECONDS = 1.5
DELETE_BATCH = 1000  # keys per DEL when the demo cleans up
SHIPPED_RULES = Path(__file__).resolve().parent / "demo_app" / "rules.yaml"


def _records(c: Coalescer) -> list[tuple[Any, float]]:
    handler = c.config.rule("user-stats").handler
    module = sys.modules[getattr(handler, "__module__", "")]
    records: list[tuple[Any, float]] = module.REFRESHED
    return records


async def _burst(c: Coalescer) -> int:
    """A bulk import: one hot user touched 10,000 times, 50 others 20 times each."""
    touches, steps = 0, 30
    for step in range(steps):
        for _ in range(HOT_TOUCHES // steps):
            c.touch("stats:user:42")
            touches += 1
        for user in range(USERS):
            if step % 3 == 0 and step // 3 < 20:
                c.touch(f"stats:user:{1000 + user}")
                touches += 1
        c.touch("stats:org:7")
        touches += 1
        await asyncio.sleep(DEMO_SECONDS / steps)
    return touches


async def _settled(c: Coalescer, expected: int, records: list[Any]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = await c.query.status()
        busy = sum(r["pending"] + r["in_flight"] for r in status["rules"].values())
        if busy == 0 and len(records) >= expected:
            return
        await asyncio.sleep(0.05)


DEMO_NODE = "demo"  # the demo node's id (its ack receipts are named for it)


def demo_config(rules: str) -> Config:
    """The rules of ``rules`` in a fresh namespace: ``demo-`` and 8 random hex digits."""
    config = load_rules(rules)
    return dataclasses.replace(config, namespace=f"demo-{secrets.token_hex(4)}")


async def delete_demo_keys(keeper: Coalescer, config: Config) -> None:
    """Delete every key the run left in its namespace (a namespace of its own): its
    shards', its keys' timelines and quiet markers, its audit stream, all of them."""
    batch: list[str] = []
    async for key in keeper.redis.scan_iter(match=namespace_glob(config.namespace),
                                            count=DELETE_BATCH):
        batch.append(key)
        if len(batch) == DELETE_BATCH:
            await keeper.redis.delete(*batch)
            batch.clear()
    if batch:
        await keeper.redis.delete(*batch)


async def run_demo(rules: str | None, redis_url: str | None) -> int:
    """The demo on ``rules`` (None: the shipped ones) and ``redis_url`` (None:
    $COALESCER_REDIS_URL, else the embedded server)."""
    config = demo_config(str(SHIPPED_RULES) if rules is None else rules)
    root = project_root(None) if rules is None else None  # not inside the package
    # A second client holds the connection (and the embedded server) open while the
    # demo node shuts down, then deletes the namespace's keys.
    keeper = Coalescer(config, redis_url=redis_url, worker=False, node_id="demo-keeper",
                       embedded_root=root)
    async with keeper:
        try:
            await _show(config, redis_url, root)
        finally:
            await delete_demo_keys(keeper, config)
    return 0


async def _show(config: Config, redis_url: str | None, root: Path | None) -> None:
    async with Coalescer(config, redis_url=redis_url, node_id=DEMO_NODE,
                         embedded_root=root) as c:
        print(f"coalescer demo on {redact(c.redis_url or '')}, rules {config.source}, "
              f"namespace {config.namespace} (deleted afterwards)")
        for rule in c.config.rules:
            print(f"  rule {rule.name}: {rule.pattern.source} window {rule.window}s, "
                  f"max_wait {rule.max_wait}s")
        records = _records(c)
        records.clear()
        started = time.monotonic()
        touches = await _burst(c)
        await c.flush()
        print(f"\n{touches:,} touches of {USERS + 2} keys in "
              f"{time.monotonic() - started:.1f}s; waiting for the quiet windows...")
        await _settled(c, USERS + 2, records)
        _report(c, touches, records)


def _report(c: Coalescer, touches: int, records: list[tuple[Any, float]]) -> None:
    keys_written = c.metrics.registry.get_sample_value("coalescer_flush_batch_keys_sum") or 0
    lags = sorted(max(0.0, t * 1000 - claim.due_ms) for claim, t in records)
    hot = [claim for claim, _ in records if claim.key == "stats:user:42"]
    print(f"refreshes: {len(records)} for {touches:,} touches "
          f"({touches / max(1, len(records)):,.0f} touches per refresh)")
    print(f"keys written to Redis: {int(keys_written):,} "
          "(the absorber kept the hot key to one write per absorb interval)")
    for claim in hot:
        print(f"  stats:user:42 refreshed once: token {claim.token}, "
              f"{claim.due_ms - claim.first_touch_ms} ms after its first touch, "
              f"{claim.due_ms - claim.last_touch_ms} ms after its last")
    if lags:
        print(f"start lag (refresh start - due): p50 {statistics.median(lags):.1f} ms, "
              f"max {lags[-1]:.1f} ms")
