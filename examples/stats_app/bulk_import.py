"""A bulk import: 10,000 orders over 100 customers, POSTed to the app in a burst.

    python -m examples.stats_app.bulk_import [--orders 10000] [--customers 100]

It then waits until ``coalescer status`` shows nothing pending or in flight, and
prints how many refreshes ran against the one per order a per-write refresh would
have run, and whether every customer's stats equal a full recompute (exit 1 if not).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from coalescer import Coalescer, Config
from examples.ports import ENV_PORT

from . import customer_stats as db
from .app import RULES

POLL_SECONDS = 0.2


def make_orders(n: int, customers: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, customers), rng.randint(100, 50_000)) for _ in range(n)]


async def post_all(app_url: str, orders: list[tuple[int, int]], batch: int,
                   parallel: int) -> int:
    """POST the orders in batches, ``parallel`` requests at a time; returns requests made."""
    batches = [orders[i:i + batch] for i in range(0, len(orders), batch)]
    gate = asyncio.Semaphore(parallel)
    async with aiohttp.ClientSession() as session:
        async def post(chunk: list[tuple[int, int]]) -> None:
            body = {"orders": [{"customer_id": c, "amount": a} for c, a in chunk]}
            async with gate, session.post(f"{app_url}/orders", json=body) as response:
                if response.status != 201:
                    raise SystemExit(f"POST /orders answered {response.status}: "
                                     f"{await response.text()}")
        await asyncio.gather(*(post(chunk) for chunk in batches))
    return len(batches)


def busy(status: dict[str, Any]) -> tuple[int, int, int]:
    """(pending, in flight, dead) over every rule."""
    rules = status["rules"].values()
    return (sum(r["pending"] for r in rules), sum(r["in_flight"] for r in rules),
            sum(r["dead"] for r in rules))


async def wait_idle(rules: Path, redis_url: str | None, timeout: float,
                    conn: db.Db | None = None) -> None:
    """Poll the coalescer status until no refresh is pending or in flight (and, with
    ``conn``, the outbox is empty: every touch reached Redis)."""
    deadline = time.monotonic() + timeout
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        while True:
            pending, in_flight, dead = busy(await c.query.status())
            if dead:
                raise SystemExit(f"{dead} refresh(es) dead-lettered: see `coalescer status`")
            waiting = db.outbox_rows(conn)[0] if conn is not None else 0
            if not pending and not in_flight and not waiting:
                return
            if time.monotonic() > deadline:
                outbox = f" and {waiting} touches in the outbox" if waiting else ""
                raise SystemExit(f"still {pending} pending, {in_flight} in flight{outbox} "
                                 f"after {timeout:g}s: is a node running (coalescer run)?")
            await asyncio.sleep(POLL_SECONDS)


def report(conn: db.Db, first_id: int, orders: int, customers: int) -> bool:
    ran = db.refreshes_since(conn, first_id)
    print(f"refreshes run: {ran} (a refresh per write would have run {orders:,})")
    wrong = db.mismatches(conn)
    checked = len(db.recomputed(conn))
    for cid, (have, want) in sorted(wrong.items())[:10]:
        print(f"  customer {cid}: stored {have}, a full recompute gives {want}")
    print(f"stats equal a full recompute for {checked - len(wrong)} of {checked} customers")
    return not wrong


async def run(args: argparse.Namespace) -> bool:
    db.init_db(args.db)
    conn = db.connect(args.db)
    try:
        first_id = db.last_refresh_id(conn)
        written = db.outbox_rows(conn)[1]
        orders = make_orders(args.orders, args.customers, args.seed)
        started = time.monotonic()
        requests = await post_all(args.app, orders, args.batch, args.parallel)
        print(f"imported {len(orders):,} orders for up to {args.customers} customers in "
              f"{time.monotonic() - started:.1f} s ({requests} requests)", flush=True)
        outbox = _reads_outbox(args.rules)
        await wait_idle(args.rules, args.redis, args.timeout, conn if outbox else None)
        if outbox:
            print(f"outbox: {db.outbox_rows(conn)[1] - written:,} touches committed with the "
                  f"orders (one row per customer per request), {db.outbox_rows(conn)[0]} "
                  "left waiting: every one reached Redis")
        return report(conn, first_id, len(orders), args.customers)
    finally:
        conn.close()


def _reads_outbox(rules: Path) -> bool:
    return any(source.type == "outbox" for source in Config.from_yaml(
        rules, import_handlers=False).sources)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.stats_app.bulk_import",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=10_000)
    parser.add_argument("--customers", type=int, default=100)
    parser.add_argument("--batch", type=int, default=100, help="orders per request")
    parser.add_argument("--parallel", type=int, default=8, help="requests at a time")
    parser.add_argument("--seed", type=int, default=1)
    port = os.environ.get(ENV_PORT) or "8080"
    parser.add_argument("--app", default=f"http://127.0.0.1:{port}",
                        help=f"the app's URL (default http://127.0.0.1:${ENV_PORT}, else :8080)")
    parser.add_argument("--db", default=None,
                        help="a SQLite file or a postgresql:// URL (default $STATS_DB, else "
                             "stats.db beside the app)")
    parser.add_argument("--rules", type=Path, default=RULES)
    parser.add_argument("--redis", default=None,
                        help="Redis URL (default $COALESCER_REDIS_URL, else the embedded server)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the refreshes")
    args = parser.parse_args(argv)
    args.db = args.db or db.database()
    sys.exit(0 if asyncio.run(run(args)) else 1)


if __name__ == "__main__":
    main()
