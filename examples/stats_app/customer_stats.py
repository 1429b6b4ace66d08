"""Orders (the source of truth) and customer_stats (the aggregate), in SQLite or
PostgreSQL, and the refresh handlers: ``refresh_customer`` recomputes one customer's row,
``refresh_customers`` (a batch handler) the rows of many customers with one query.

The node imports this file as ``customer_stats`` (rules.yaml names
``customer_stats:refresh_customer``, rules_batch.yaml ``customer_stats:refresh_customers``;
the rules file's folder is first on sys.path
there); the app and the import script import it as ``examples.stats_app.customer_stats``.
The database is ``$STATS_DB``, else ``stats.db`` beside this file: a SQLite file, or a
PostgreSQL URL (``postgresql://user:password@host/dbname``, read with psycopg 3; the
SQLAlchemy spelling ``postgresql+psycopg://...`` that the outbox source reads works too).

Everything that differs between the two is in ``Db`` and the two schemas below; every
other statement is the same on both (``ON CONFLICT ... DO UPDATE ... WHERE`` included).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from coalescer import Claim
from coalescer.integrations.outbox_rows import postgres_ddl

log = logging.getLogger(__name__)

DB_ENV = "STATS_DB"
DEFAULT_DB = Path(__file__).resolve().with_name("stats.db")
KEY_FORMAT = "stats:customer:{}"
POSTGRES_SCHEMES = ("postgresql", "postgres")

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL,
    amount INTEGER NOT NULL,           -- cents, so that sums are exact
    created_at INTEGER NOT NULL        -- epoch milliseconds
);
CREATE INDEX IF NOT EXISTS orders_by_customer ON orders (customer_id);
CREATE TABLE IF NOT EXISTS customer_stats (
    customer_id INTEGER PRIMARY KEY,
    orders INTEGER NOT NULL,
    total INTEGER NOT NULL,
    avg REAL NOT NULL,
    last_order_at INTEGER,
    token INTEGER NOT NULL             -- fencing token of the refresh that wrote this row
);
-- The outbox (rules_outbox.yaml): a touch per customer, written in the orders' transaction
-- and deleted by the node once Redis holds it. AUTOINCREMENT: an id is never reused.
CREATE TABLE IF NOT EXISTS coalescer_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    item TEXT,
    created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE IF NOT EXISTS refresh_log (   -- one row per refresh run, to count them
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL,
    token INTEGER NOT NULL,
    applied INTEGER NOT NULL,          -- 0: refused, a newer refresh had written already
    at INTEGER NOT NULL
);
"""

# The same tables in PostgreSQL: identity columns for the ids, DOUBLE PRECISION for avg
# (PostgreSQL's REAL has 6 digits), and the outbox with the trigger that NOTIFYs the
# nodes when rows commit (postgres_ddl, run by init_db after these statements).
POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id BIGINT NOT NULL,
    amount BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS orders_by_customer ON orders (customer_id);
CREATE TABLE IF NOT EXISTS customer_stats (
    customer_id BIGINT PRIMARY KEY,
    orders BIGINT NOT NULL,
    total BIGINT NOT NULL,
    avg DOUBLE PRECISION NOT NULL,
    last_order_at BIGINT,
    token BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS coalescer_outbox (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key TEXT NOT NULL,
    item TEXT,
    created_at TIMESTAMPTZ NOT NULL DEFAULT CURRENT_TIMESTAMP
);
CREATE TABLE IF NOT EXISTS refresh_log (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id BIGINT NOT NULL,
    token BIGINT NOT NULL,
    applied INTEGER NOT NULL,
    at BIGINT NOT NULL
);
"""

AGGREGATE = """
SELECT COUNT(*), COALESCE(SUM(amount), 0), COALESCE(AVG(amount), 0.0), MAX(created_at)
FROM orders WHERE customer_id = ?
"""

# The fenced write. A refresh writes only if its token is larger than the token of the
# row's last writer: a stale holder (its claim lease expired while it was paused, and a
# newer claim has refreshed since) is refused, and changes nothing. The same guard for
# a plain UPDATE: "UPDATE customer_stats SET ... WHERE customer_id = ? AND token < ?".
FENCED_UPSERT = """
INSERT INTO customer_stats (customer_id, orders, total, avg, last_order_at, token)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (customer_id) DO UPDATE SET
    orders = excluded.orders, total = excluded.total, avg = excluded.avg,
    last_order_at = excluded.last_order_at, token = excluded.token
WHERE excluded.token > customer_stats.token
"""

# A batch's aggregates in one query: the customers of the batch, grouped.
BATCH_AGGREGATE = """
SELECT customer_id, COUNT(*), SUM(amount), AVG(amount), MAX(created_at)
FROM orders WHERE customer_id IN ({marks}) GROUP BY customer_id
"""

FULL_RECOMPUTE = """
SELECT customer_id, COUNT(*), SUM(amount), AVG(amount), MAX(created_at)
FROM orders GROUP BY customer_id
"""


class Stats(NamedTuple):
    orders: int
    total: int
    avg: float
    last_order_at: int | None


def database() -> str:
    """``$STATS_DB``, else stats.db beside this file."""
    return os.environ.get(DB_ENV) or str(DEFAULT_DB)


def is_postgres(target: str | os.PathLike[str]) -> bool:
    """A PostgreSQL URL (``postgresql://``, ``postgres://``, or with a SQLAlchemy driver
    name: ``postgresql+psycopg://``), not a SQLite file."""
    scheme, sep, _ = str(target).partition("://")
    return bool(sep) and scheme.split("+", 1)[0] in POSTGRES_SCHEMES


def libpq_url(url: str) -> str:
    """``url`` as psycopg reads it: a SQLAlchemy driver name (``+psycopg``) left out."""
    scheme, sep, rest = url.partition("://")
    return scheme.split("+", 1)[0] + sep + rest


class Cursor(Protocol):
    """What this file uses of a cursor: sqlite3's and psycopg's alike."""

    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Db:
    """A connection to SQLite or PostgreSQL, in autocommit mode: transactions are explicit
    (``with db.transaction():``). Statements are written with ``?`` placeholders; on
    PostgreSQL they become psycopg's ``%s``."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.postgres = is_postgres(target)
        if self.postgres:
            import psycopg  # only needed for PostgreSQL

            self.conn: Any = psycopg.connect(libpq_url(str(target)), autocommit=True)
        else:
            self.conn = sqlite3.connect(target, timeout=30.0, isolation_level=None)
            self.conn.execute("PRAGMA busy_timeout = 30000")

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.postgres else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        cursor: Cursor = self.conn.execute(self._sql(sql), params)
        return cursor

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self.postgres:
            with self.conn.cursor() as cursor:
                cursor.executemany(self._sql(sql), rows)
        else:
            self.conn.executemany(sql, rows)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, or ROLLBACK on an error. SQLite's BEGIN IMMEDIATE takes the
        write lock at once (a deferred one could fail to upgrade mid-transaction)."""
        self.conn.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def connect(target: str | os.PathLike[str] | None = None) -> Db:
    """A connection to ``target`` (a SQLite path or a PostgreSQL URL), else ``$STATS_DB``."""
    return Db(target or database())


def init_db(target: str | os.PathLike[str] | None = None) -> None:
    """Create the tables if needed. SQLite: WAL lets readers run beside the one writer.
    PostgreSQL: one transaction, the outbox's NOTIFY trigger included."""
    db = connect(target)
    try:
        if db.postgres:
            with db.transaction():
                db.conn.execute(POSTGRES_SCHEMA)  # several statements: no parameters
                for statement in postgres_ddl("coalescer_outbox"):
                    db.conn.execute(statement)
        else:
            db.conn.execute("PRAGMA journal_mode = WAL")
            db.conn.executescript(SQLITE_SCHEMA)
    finally:
        db.close()


OUTBOX_ROWS = 400  # touches per INSERT into the outbox (SQLite's old 999-variable limit)


def add_orders(conn: Db, orders: Iterable[tuple[int, int]], *,
               outbox: bool = False) -> int:
    """Insert (customer_id, amount) rows in one transaction; returns how many. With
    ``outbox``, the same transaction writes a touch of each customer into the outbox
    (one multi-row INSERT): they commit, or roll back, with the orders."""
    now = time.time_ns() // 1_000_000
    rows = [(customer, amount, now) for customer, amount in orders]
    with conn.transaction():
        conn.executemany(
            "INSERT INTO orders (customer_id, amount, created_at) VALUES (?, ?, ?)", rows)
        if outbox:
            touch_in_outbox(conn, {customer for customer, _, _ in rows})
    return len(rows)


def touch_in_outbox(conn: Db, customer_ids: Iterable[int]) -> None:
    """Touches of the customers as outbox rows, in the caller's transaction."""
    keys = [KEY_FORMAT.format(customer) for customer in sorted(customer_ids)]
    for start in range(0, len(keys), OUTBOX_ROWS):
        chunk = keys[start:start + OUTBOX_ROWS]
        marks = ", ".join("(?)" for _ in chunk)
        conn.execute(f"INSERT INTO coalescer_outbox (key) VALUES {marks}", chunk)


# The highest outbox id ever written, though the node deletes the rows. PostgreSQL: the
# identity column's sequence (NULL until its first use; an id taken by a transaction that
# rolled back counts too, and none does here).
LAST_OUTBOX_ID = {
    "sqlite": "SELECT seq FROM sqlite_sequence WHERE name = 'coalescer_outbox'",
    "postgres": "SELECT pg_sequence_last_value("
                "pg_get_serial_sequence('coalescer_outbox', 'id'))",
}


def outbox_rows(conn: Db) -> tuple[int, int]:
    """Rows waiting in the outbox, and the highest id ever written."""
    waiting = conn.execute("SELECT COUNT(*) FROM coalescer_outbox").fetchone()[0]
    found = conn.execute(LAST_OUTBOX_ID["postgres" if conn.postgres else "sqlite"]).fetchone()
    return int(waiting), int(found[0]) if found and found[0] is not None else 0


def compute(conn: Db, customer_id: int) -> Stats:
    """One customer's aggregates, from the orders committed so far."""
    orders, total, avg, last = conn.execute(AGGREGATE, (customer_id,)).fetchone()
    return Stats(int(orders), int(total), float(avg), last)


def write_stats(conn: Db, customer_id: int, stats: Stats, token: int) -> bool:
    """Store ``stats`` unless a refresh with a token >= ``token`` already did; True if
    written. Also records the run in refresh_log."""
    with conn.transaction():
        cursor = conn.execute(FENCED_UPSERT, (customer_id, *stats, token))
        applied = cursor.rowcount == 1
        conn.execute("INSERT INTO refresh_log (customer_id, token, applied, at) "
                     "VALUES (?, ?, ?, ?)",
                     (customer_id, token, int(applied), time.time_ns() // 1_000_000))
    return applied


def refresh(conn: Db, customer_id: int, token: int) -> bool:
    """Recompute one customer's row and write it, fenced by ``token``.

    The aggregate is read outside the write transaction, as a heavy GROUP BY would be
    (it need not hold the database's write lock). That is what makes the fence matter:
    a holder paused between its read and its write may write old figures after a newer
    refresh wrote fresh ones; its smaller token gets it refused.
    """
    return write_stats(conn, customer_id, compute(conn, customer_id), token)


def refresh_customer(claim: Claim) -> None:
    """The handler rules.yaml names: a plain function, run in coalescer's thread pool."""
    customer_id = int(claim.params["customer_id"])
    conn = connect()
    try:
        if not refresh(conn, customer_id, claim.token):
            log.info("%s: token %d refused, a newer refresh already wrote", claim.key,
                     claim.token)
    finally:
        conn.close()


def compute_many(conn: Db, customer_ids: list[int]) -> dict[int, Stats]:
    """Many customers' aggregates with one ``GROUP BY ... WHERE customer_id IN (...)``;
    a customer without orders gets zeros."""
    marks = ",".join("?" * len(customer_ids))
    found = {row[0]: Stats(int(row[1]), int(row[2]), float(row[3]), row[4])
             for row in conn.execute(BATCH_AGGREGATE.format(marks=marks), customer_ids)}
    return {cid: found.get(cid, Stats(0, 0, 0.0, None)) for cid in customer_ids}


def write_many(conn: Db, rows: list[tuple[int, Stats, int]]) -> int:
    """Store each (customer_id, stats, token) fenced by its token, all in one transaction
    (logged in refresh_log); returns how many were written."""
    now = time.time_ns() // 1_000_000
    written = 0
    with conn.transaction():
        for customer_id, stats, token in rows:
            applied = conn.execute(FENCED_UPSERT, (customer_id, *stats, token)).rowcount == 1
            written += applied
            conn.execute("INSERT INTO refresh_log (customer_id, token, applied, at) "
                         "VALUES (?, ?, ?, ?)", (customer_id, token, int(applied), now))
    return written


def refresh_customers(claims: list[Claim]) -> None:
    """The batch handler rules_batch.yaml names: every customer of the batch with one
    query and one transaction. Each row is still fenced by its own claim's token.
    Returning None says every key succeeded; raising fails (and retries) them all."""
    tokens = {int(claim.params["customer_id"]): claim.token for claim in claims}
    conn = connect()
    try:
        stats = compute_many(conn, list(tokens))
        written = write_many(conn, [(cid, stats[cid], token) for cid, token in tokens.items()])
    finally:
        conn.close()
    if written < len(tokens):
        log.info("%d of %d rows refused: a newer refresh had already written them",
                 len(tokens) - written, len(tokens))


def stored(conn: Db) -> dict[int, Stats]:
    rows = conn.execute("SELECT customer_id, orders, total, avg, last_order_at "
                        "FROM customer_stats").fetchall()
    return {row[0]: Stats(*row[1:]) for row in rows}


def recomputed(conn: Db) -> dict[int, Stats]:
    """Every customer's aggregates by a full recompute (what the stored rows must equal)."""
    return {row[0]: Stats(int(row[1]), int(row[2]), float(row[3]), row[4])
            for row in conn.execute(FULL_RECOMPUTE)}


def mismatches(conn: Db) -> dict[int, tuple[Stats | None, Stats]]:
    """Customers whose stored stats differ from a full recompute: id -> (stored, expected)."""
    have, want = stored(conn), recomputed(conn)
    return {cid: (have.get(cid), expected) for cid, expected in want.items()
            if have.get(cid) != expected}


def refreshes_since(conn: Db, after_id: int) -> int:
    return int(conn.execute("SELECT COUNT(*) FROM refresh_log WHERE id > ?",
                            (after_id,)).fetchone()[0])


def last_refresh_id(conn: Db) -> int:
    return int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM refresh_log").fetchone()[0])
