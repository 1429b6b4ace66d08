"""The web app: POST /orders writes orders, GET /customers/{id}/stats reads the aggregate.

    python -m examples.stats_app.app [--port PORT] [--db PATH_OR_URL] [--redis URL]

It listens on 127.0.0.1, port ``--port``, else ``$PORT``, else 8080.

The write path touches ``stats:customer:{id}`` for every order it committed; a
coalescer node (``coalescer run --rules examples/stats_app/rules.yaml``) runs the
refresh once per customer, a quiet window after the last touch. This process only
touches (``worker=False``): it never runs refreshes itself.

With ``--outbox`` (the recommended set-up) the touches are rows of the outbox table,
written in the orders' own transaction, and the node reads them
(``coalescer run --rules examples/stats_app/rules_outbox.yaml``): an app killed right
after a commit loses no touch, and the app needs no Redis connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from coalescer import Coalescer
from examples.ports import add_port_option, announce, chosen_port

from . import customer_stats as db

DEFAULT_PORT = 8080

RULES = Path(__file__).resolve().with_name("rules.yaml")
COALESCER = web.AppKey("coalescer", Coalescer)
DATABASE = web.AppKey("database", str)
OUTBOX = web.AppKey("outbox", bool)
MAX_ORDERS = 1000


def _int_field(order: Any, where: str, name: str, low: int) -> int:
    if not isinstance(order, dict):
        raise ValueError(f"{where} must be an object, got {type(order).__name__}")
    value = order.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}.{name} must be an integer >= {low}, got {value!r}")
    return value


def parse_orders(body: Any) -> list[tuple[int, int]]:
    """``{"orders": [{"customer_id": 7, "amount": 1250}, ...]}`` (amounts in cents) or a
    single order object; ValueError naming the first bad field."""
    items = body.get("orders") if isinstance(body, dict) and "orders" in body else [body]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_ORDERS:
        raise ValueError(f"orders must be a list of 1 to {MAX_ORDERS} orders")
    return [(_int_field(o, f"orders[{i}]", "customer_id", 1),
             _int_field(o, f"orders[{i}]", "amount", 0)) for i, o in enumerate(items)]


def _insert(database: str, orders: list[tuple[int, int]], outbox: bool) -> None:
    conn = db.connect(database)
    try:
        db.add_orders(conn, orders, outbox=outbox)
    finally:
        conn.close()


async def post_orders(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:  # not UTF-8, or not JSON
        return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
    try:
        orders = parse_orders(body)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    if request.app[OUTBOX]:  # the touches committed with the orders: nothing more to do
        await asyncio.to_thread(_insert, request.app[DATABASE], orders, True)
        return web.json_response({"inserted": len(orders)}, status=201)
    await asyncio.to_thread(_insert, request.app[DATABASE], orders, False)
    # Touch only AFTER the commit. A refresh can start any time after its touch reaches
    # Redis: at once when the key's max_wait ran out during a long burst, or while a slow
    # commit waits for a lock. Touched before the commit, it could read the orders table
    # without these rows and store the old figures; that touch consumed, nothing would
    # refresh the customer again: a lost update. Touched after, every refresh that
    # follows the touch sees these rows.
    coalescer = request.app[COALESCER]
    for customer_id, _ in orders:
        coalescer.touch(db.KEY_FORMAT.format(customer_id))
    # Optional: answer once Redis holds the due times, so a client that then sees
    # `coalescer status` with nothing pending knows its orders are reflected.
    await coalescer.flush()
    return web.json_response({"inserted": len(orders)}, status=201)


def _read_stats(database: str, customer_id: int) -> db.Stats | None:
    conn = db.connect(database)
    try:
        return db.stored(conn).get(customer_id)
    finally:
        conn.close()


async def get_stats(request: web.Request) -> web.Response:
    try:
        customer_id = int(request.match_info["customer_id"])
    except ValueError:
        return web.json_response({"error": "customer id must be an integer"}, status=400)
    stats = await asyncio.to_thread(_read_stats, request.app[DATABASE], customer_id)
    if stats is None:
        return web.json_response({"error": f"no stats for customer {customer_id} yet"},
                                 status=404)
    return web.json_response({"customer_id": customer_id, **stats._asdict()})


def make_app(database: str | Path, redis_url: str | None = None, rules: Path = RULES, *,
             outbox: bool = False) -> web.Application:
    app = web.Application()
    app[DATABASE] = str(database)
    app[OUTBOX] = outbox
    db.init_db(database)
    if outbox:  # no coalescer in this process: the node reads the outbox
        _routes(app)
        return app

    async def coalescer_ctx(app: web.Application) -> AsyncIterator[None]:
        async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
            app[COALESCER] = c
            yield  # leaving flushes every buffered touch to Redis

    app.cleanup_ctx.append(coalescer_ctx)
    _routes(app)
    return app


def _routes(app: web.Application) -> None:
    app.router.add_post("/orders", post_orders)
    app.router.add_get("/customers/{customer_id}/stats", get_stats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.stats_app.app",
                                     description="The statistics example's web app.")
    parser.add_argument("--host", default="127.0.0.1")
    add_port_option(parser, DEFAULT_PORT)
    parser.add_argument("--db", default=None,
                        help="a SQLite file or a postgresql:// URL (default $STATS_DB, else "
                             "stats.db beside this file)")
    parser.add_argument("--redis", default=None,
                        help="Redis URL (default $COALESCER_REDIS_URL, else the embedded server)")
    parser.add_argument("--outbox", action="store_true",
                        help="write the touches as outbox rows in the orders' transaction "
                             "(the node runs rules_outbox.yaml)")
    args = parser.parse_args(argv)
    port, source = chosen_port(parser, args.port, DEFAULT_PORT)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = make_app(args.db or db.database(), args.redis, outbox=args.outbox)
    announce("the stats app", args.host, port, source)
    web.run_app(app, host=args.host, port=port, access_log=None)


if __name__ == "__main__":
    main()
