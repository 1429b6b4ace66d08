"""A tiny shop: orders in SQLite, published to Kafka with the time they must be paid by.

``place`` writes the order (unpaid) and publishes ``{"orderId", "payBy"}`` to the
``orders`` topic, ``payBy`` being the placing time plus the minutes it may stay unpaid
(ISO 8601, UTC); coalescer's Kafka source schedules ``order:unpaid:<id>`` at that time
(``at:``), however late the message is read, and ``cancel_if_unpaid`` (the rule's
handler) cancels the order then if it is still unpaid. ``pay`` marks the order paid and
cancels the pending check.

    python -m examples.orders.shop place ORDER_ID MINUTES
    python -m examples.orders.shop pay ORDER_ID
    python -m examples.orders.shop show

The database is ``$ORDERS_DB`` (default ``orders.db`` in the current folder); the broker
``$KAFKA_BOOTSTRAP``; Redis ``$COALESCER_REDIS_URL`` (default: the embedded server).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from coalescer import Claim, Coalescer

RULES = Path(__file__).with_name("rules.yaml")
TOPIC = "orders"


def connect() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ.get("ORDERS_DB", "orders.db"), timeout=10)
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, "
                 "status TEXT NOT NULL CHECK (status IN ('unpaid', 'paid', 'cancelled')))")
    return conn


def cancel_if_unpaid(claim: Claim) -> None:
    """The rule's handler: the order's time came; cancel it unless it was paid."""
    order_id = claim.key.removeprefix("order:unpaid:")
    with connect() as conn:
        conn.execute("UPDATE orders SET status = 'cancelled' WHERE id = ? AND status = "
                     "'unpaid'", (order_id,))


def pay_by(minutes: float) -> str:
    """The time an order placed now must be paid by: ISO 8601 text, UTC."""
    now = datetime.datetime.now(datetime.UTC)
    return (now + datetime.timedelta(minutes=minutes)).isoformat(timespec="milliseconds")


async def place(order_id: str, minutes: float) -> str:
    """Write the order, then publish it with the time it must be paid by (returned)."""
    from aiokafka import AIOKafkaProducer  # type: ignore[import-untyped]

    with connect() as conn:
        conn.execute("INSERT INTO orders (id, status) VALUES (?, 'unpaid')", (order_id,))
    producer = AIOKafkaProducer(bootstrap_servers=os.environ["KAFKA_BOOTSTRAP"])
    await producer.start()
    try:
        deadline = pay_by(minutes)
        value = json.dumps({"orderId": order_id, "payBy": deadline}).encode()
        await producer.send_and_wait(TOPIC, value, key=order_id.encode())
    finally:
        await producer.stop()
    return deadline


async def pay(order_id: str, rules: Path = RULES, **options: Any) -> str:
    """Mark the order paid and drop its pending check; says what it did."""
    with connect() as conn:
        paid = conn.execute("UPDATE orders SET status = 'paid' WHERE id = ? AND status = "
                            "'unpaid'", (order_id,)).rowcount == 1
    if not paid:
        return "not unpaid: nothing to do"
    async with Coalescer.from_yaml(rules, worker=False, **options) as c:
        outcome = await c.cancel(f"order:unpaid:{order_id}")
    # a check not pending yet (its message not read yet) finds the order paid
    return "paid; check dropped" if outcome.cancelled else "paid"


def show() -> dict[str, str]:
    with connect() as conn:
        return dict(conn.execute("SELECT id, status FROM orders ORDER BY id").fetchall())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.orders.shop")
    commands = parser.add_subparsers(dest="command", required=True)
    placing = commands.add_parser("place", help="write an order and publish it")
    placing.add_argument("order_id")
    placing.add_argument("minutes", type=float, help="minutes it may stay unpaid")
    commands.add_parser("pay", help="pay an order").add_argument("order_id")
    commands.add_parser("show", help="every order and its status")
    args = parser.parse_args(argv)
    if args.command == "place":
        asyncio.run(place(args.order_id, args.minutes))
    elif args.command == "pay":
        print(asyncio.run(pay(args.order_id)))
    else:
        for order_id, status in show().items():
            print(order_id, status)


if __name__ == "__main__":
    main()
