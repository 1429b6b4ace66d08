"""python -m examples.node_writer.demo [--redis-url URL]: a Node.js writer touches keys,
a Python node refreshes them.

It starts a coalescer node in this process (the rules of ``rules.yaml``, in a namespace
of its own: ``demo-`` and random hex digits), runs ``writer.mjs`` in Node (a bulk import
that touches keys with the TypeScript client of ``clients/node``, which must be built:
``npm ci && npm run build`` there), waits until the node has refreshed every key the
writer touched, prints what ran, and deletes the namespace's keys. Redis is ``--redis-url``,
else ``$COALESCER_REDIS_URL``, else the embedded server (as ``coalescer demo``).

Exits 0 when every key the Node writer touched was refreshed exactly once; 1 when not,
or when Redis or the writer failed (saying what failed); 2 when Node or the built client
is missing (saying what to run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from coalescer.claim import Claim
from coalescer.cli.demo import delete_demo_keys, demo_config
from coalescer.coalescer import Coalescer
from coalescer.common.redact import redact
from coalescer.config.rules import Config
from coalescer.errors import CoalescerError
from coalescer.store.embedded import project_root
from examples.node_writer import handlers

HERE = Path(__file__).resolve().parent
CLIENT = HERE.parent.parent / "clients" / "node"
RULES = HERE / "rules.yaml"
WRITER = HERE / "writer.mjs"
WRITER_TIMEOUT = 120.0  # seconds the Node writer may take
SETTLE_TIMEOUT = 30.0  # seconds to wait for the node's refreshes after the writer's flush


class DemoFailed(Exception):
    """The demo could not show what it shows (the message says why)."""


def missing() -> str | None:
    """What the demo needs and this machine lacks (None: nothing)."""
    if shutil.which("node") is None:
        return "node is not on PATH: install Node.js 18 or later"
    if not (CLIENT / "dist" / "index.js").exists() or not (CLIENT / "node_modules").exists():
        return f"the TypeScript client is not built: run `npm ci && npm run build` in {CLIENT}"
    return None


async def run_writer(redis_url: str, namespace: str) -> dict[str, Any]:
    """Run writer.mjs against ``redis_url`` in ``namespace``; what it says it touched."""
    env = {**os.environ, "COALESCER_REDIS_URL": redis_url, "COALESCER_NAMESPACE": namespace}
    proc = await asyncio.create_subprocess_exec(
        "node", str(WRITER), str(RULES), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), WRITER_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise DemoFailed(f"the Node writer did not finish within {WRITER_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        raise DemoFailed(f"the Node writer exited {proc.returncode}: "
                         f"{err.decode(errors='replace').strip()[-1500:]}")
    written: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return written


async def settle(c: Coalescer, keys: set[str]) -> None:
    """Wait until every key of ``keys`` was refreshed and nothing is pending or running."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while time.monotonic() < deadline:
        refreshed = {claim.key for claim, _ in handlers.REFRESHED}
        status = await c.query.status()
        busy = sum(r["pending"] + r["in_flight"] for r in status["rules"].values())
        if keys <= refreshed and busy == 0:
            return
        await asyncio.sleep(0.05)
    left = sorted(keys - {claim.key for claim, _ in handlers.REFRESHED})
    raise DemoFailed(f"{len(left)} keys the Node writer touched were not refreshed within "
                     f"{SETTLE_TIMEOUT:.0f} s: {', '.join(left[:10])}")


def report(written: dict[str, Any], claims: list[Claim]) -> int:
    """Print what the node ran for the writer's touches; 0 when each key ran once."""
    keys = set(written["keys"])
    runs: dict[str, list[Claim]] = {}
    for claim in claims:
        runs.setdefault(claim.key, []).append(claim)
    print(f"Node writer: {written['touches']:,} touches of {len(keys)} keys in "
          f"{written['seconds']:.1f} s, then flush() (Redis held them all)")
    print(f"Python node: {len(claims)} refreshes")
    for claim in runs.get("stats:user:42", []):
        print(f"  stats:user:42 (touched 10,000 times): refreshed once, "
              f"{claim.due_ms - claim.last_touch_ms} ms after its last touch")
    for claim in runs.get("orders:shop1:9", []):
        print(f"  orders:shop1:9: refreshed once with the items the Node writer touched: "
              f"{', '.join(sorted(claim.items))}")
    for claim in runs.get("stats:user:later", []):
        print(f"  stats:user:later (delay \"2s\"): due {claim.due_ms - claim.first_touch_ms} ms "
              "after Redis took its touch (the server's clock)")
    wrong = sorted(k for k in keys if len(runs.get(k, [])) != 1)
    extra = sorted(set(runs) - keys)
    if wrong or extra:
        print(f"NOT exactly once: {', '.join(wrong + extra)}", file=sys.stderr)
        return 1
    print(f"every one of the {len(keys)} keys the Node writer touched was refreshed exactly once")
    return 0


async def run(redis_url: str | None) -> int:
    config = demo_config(str(RULES))
    root = None if redis_url else project_root(None)
    handlers.REFRESHED.clear()
    # A second client holds the connection (and the embedded server) open while the
    # node shuts down, then deletes the namespace's keys.
    async with Coalescer(config, redis_url=redis_url, worker=False,
                         node_id="node-writer-demo-keeper", embedded_root=root) as keeper:
        try:
            return await _show(config, redis_url, root)
        finally:
            await delete_demo_keys(keeper, config)


async def _show(config: Config, redis_url: str | None, root: Path | None) -> int:
    async with Coalescer(config, redis_url=redis_url, node_id="node-writer-demo",
                         embedded_root=root) as c:
        url = c.redis_url or ""
        print(f"Node writer demo on {redact(url)}, rules {RULES.name}, namespace "
              f"{config.namespace} (deleted afterwards)")
        written = await run_writer(url, config.namespace)
        await settle(c, set(written["keys"]))
    return report(written, [claim for claim, _ in handlers.REFRESHED])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.node_writer.demo",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("COALESCER_REDIS_URL"),
                        help="Redis to use (default $COALESCER_REDIS_URL, else the "
                             "embedded server)")
    args = parser.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"node writer demo: {why}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args.redis_url))
    except (DemoFailed, CoalescerError) as e:
        print(f"node writer demo: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
