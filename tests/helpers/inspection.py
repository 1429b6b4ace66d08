"""Helpers of the explain / history / dead-letter tests: rules, a handler, nodes.

The handler module (one per test, a unique name) succeeds for ``ok:*`` and
``item:*`` keys, raises for ``bad:*`` keys, sleeps past the timeout for
``slow:*`` keys, and waits on ``gate`` (an asyncio.Event) for ``hold:*`` keys.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from coalescer import Coalescer

HANDLER = """\
import asyncio

gate = asyncio.Event()
calls = []


async def refresh(claim):
    calls.append(claim)
    if claim.key.startswith("bad:"):
        raise RuntimeError("no such user: " + claim.key)
    if claim.key.startswith("slow:"):
        await asyncio.sleep(60)
    if claim.key.startswith("hold:"):
        await gate.wait()
"""

# Short windows and retries so tests run fast; the ``history`` line is optional.
FAST = """\
namespace: {ns}
shards: {shards}
claim_lease: 5s
{history}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: {timeout}
  concurrency: {concurrency}
  retry: {{attempts: {attempts}, backoff: {backoff}, max_backoff: {backoff}}}
rules:
  - name: ok
    match: "ok:{{id}}"
    handler: {{mod}}:refresh
  - name: bad
    match: "bad:*"
    handler: {{mod}}:refresh
  - name: slow
    match: "slow:*"
    handler: {{mod}}:refresh
  - name: hold
    match: "hold:*"
    handler: {{mod}}:refresh
"""

# Every setting at its default (window 2s, max_wait 30s, concurrency 16, 5 attempts...).
DEFAULTS = """\
namespace: {ns}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


def fast_rules(ns: str, *, shards: int = 1, history: int | None = None, attempts: int = 1,
               backoff: str = "20ms", timeout: str = "200ms", concurrency: int = 16) -> str:
    line = "" if history is None else f"history: {history}"
    return FAST.format(ns=ns, shards=shards, history=line, attempts=attempts,
                       backoff=backoff, timeout=timeout, concurrency=concurrency)


def write(folder: Path, namespace: str, yaml_text: str) -> tuple[Path, ModuleType]:
    """Write a handler module and rules.yaml in ``folder``; returns (rules, module)."""
    name = f"h_{namespace}"
    (folder / f"{name}.py").write_text(HANDLER)
    path = folder / "rules.yaml"
    path.write_text(textwrap.dedent(yaml_text).replace("{mod}", name))
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    return path, importlib.import_module(name)


@asynccontextmanager
async def node(rules: Path, redis_url: str, **options: Any) -> AsyncIterator[Coalescer]:
    options.setdefault("node_id", "node-a")
    options.setdefault("grace", 0.5)
    async with Coalescer.from_yaml(rules, redis_url=redis_url, **options) as c:
        yield c


async def dead_count(c: Coalescer) -> int:
    status = await c.query.status()
    return sum(int(r["dead"]) for r in status["rules"].values())
