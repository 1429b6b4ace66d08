"""The two databases an outbox source reads: PostgreSQL (psycopg 3, async) and SQLite
(aiosqlite). Each claims rows, keeps them until told the touches are in Redis, and
then deletes them (``done``) or leaves them for the next claim (``undo``).

How each claims (PostgreSQL: ``DELETE ... FOR UPDATE SKIP LOCKED ... RETURNING`` in a
transaction committed only by ``done``, with a second connection that LISTENs; SQLite:
a read, then ``done`` deletes up to the highest id read in a short transaction of its
own) and why that loses nothing: docs/sources.md, "The outbox source", "Guarantees".
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from coalescer.config.sources import OutboxSource, outbox_scheme
from coalescer.sources.outbox_sql import channel, quoted

log = logging.getLogger(__name__)

Row = tuple[str, str | None]  # key, item
RowFields = dict[str, str | None]  # the columns a source's at:/delay: reads, as text
COUNT_CAP = 100_000  # the backlog is counted up to this many rows
CONNECT_TIMEOUT = 5  # seconds
IDLE_MS = 30_000  # a claim's transaction idle this long is ended by the server
DRIVERS = {"postgresql": ("psycopg", "postgres"), "sqlite": ("aiosqlite", "sqlite")}


@dataclass(frozen=True, slots=True)
class Backlog:
    """Rows waiting (``capped``: at least that many) and the oldest one's age, seconds."""

    rows: int
    capped: bool
    lag: float


def driver_problem(scheme: str) -> str | None:
    """Why the driver of ``scheme`` cannot be imported here (naming the extra), or None."""
    module, extra = DRIVERS[scheme]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (f"reading {scheme} needs the {module} package, which is not installed "
                f"({exc}): pip install 'coalescer[{extra}]'")
    return None


def time_columns(source: OutboxSource) -> str:
    """The SQL that selects the columns the source's ``at:``/``delay:`` reads, after key
    and item ("" without one)."""
    return "".join(f", {quoted(name)}" for name in source.time_fields)


def column_text(value: Any) -> str | None:
    """A column's value as the text a template is filled with (a datetime in ISO-8601)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def row_fields(source: OutboxSource, rows: list[Any], start: int) -> list[RowFields]:
    """Each row's time columns (from position ``start``) by name; empty without them."""
    names = source.time_fields
    if not names:
        return []
    return [dict(zip(names, map(column_text, row[start:]), strict=True)) for row in rows]


class Outbox(ABC):
    """One outbox table on one database connection (two for PostgreSQL's LISTEN).
    ``fields`` holds, for a source with ``at:``/``delay:``, the time columns of each
    row of the last claim, in order."""

    fields: list[RowFields] = []  # noqa: RUF012  (replaced, never mutated)

    @abstractmethod
    async def connect(self) -> None:
        """Open the connection(s); ready to claim."""

    @abstractmethod
    async def claim(self, limit: int, up_to: int | None = None) -> list[Row]:
        """The first ``limit`` rows (with ids up to ``up_to``, if given), held until
        ``done`` or ``undo``."""

    @abstractmethod
    async def newest(self) -> int | None:
        """The highest id in the table now; None when it is empty."""

    @abstractmethod
    async def done(self) -> None:
        """Delete the rows of the last claim: Redis holds their touches."""

    @abstractmethod
    async def undo(self) -> None:
        """Leave the rows of the last claim in the table, for the next claim."""

    @abstractmethod
    async def backlog(self) -> Backlog:
        """How many rows wait, and how old the oldest is."""

    @abstractmethod
    async def wait(self, timeout: float) -> None:
        """Return when rows may have arrived, after ``timeout`` at the latest."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection(s); rows held go back to the table."""


def _bound(up_to: int | None, mark: str) -> tuple[str, tuple[int, ...]]:
    """The WHERE clause (and its parameter) of a claim of ids up to ``up_to``, if given."""
    return ("", ()) if up_to is None else (f" WHERE id <= {mark}", (up_to,))


def open_outbox(source: OutboxSource, url: str, rules_dir: Path) -> Outbox:
    """The outbox of ``source`` at ``url`` (resolved); a relative SQLite path is taken
    from the rules file's folder."""
    if outbox_scheme(url) == "sqlite":
        return SqliteOutbox(source, sqlite_path(url, rules_dir))
    return PostgresOutbox(source, libpq_url(url))


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as libpq reads it: the ``+driver`` dropped."""
    scheme, _, rest = url.partition("://")
    return f"postgresql://{rest}" if "+" in scheme or scheme == "postgres" else url


def sqlite_path(url: str, rules_dir: Path) -> Path:
    """The file of a SQLAlchemy SQLite URL: ``sqlite:///rel.db`` (from ``rules_dir``)
    or ``sqlite:////abs/path.db``; query options are left out."""
    path = url.partition("://")[2].partition("?")[0]
    path = path[1:] if path.startswith("/") else path
    found = Path(path)
    return found if found.is_absolute() else rules_dir / found


class PostgresOutbox(Outbox):
    """An outbox table in PostgreSQL, claimed with FOR UPDATE SKIP LOCKED."""

    def __init__(self, source: OutboxSource, url: str) -> None:
        self._source = source
        self._url = url
        self._table = quoted(source.table)
        self._channel = channel(source.table)
        self._conn: Any = None
        self._listener: Any = None
        self._wake = asyncio.Event()
        self._listening: asyncio.Task[None] | None = None
        self._warned = False  # of a missing trigger: once, not at every reconnect

    async def connect(self) -> None:
        import psycopg

        await self.close()
        self._conn = await psycopg.AsyncConnection.connect(
            self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
        # a node that stalls holding rows loses them to the others after this
        await self._conn.execute(f"SET idle_in_transaction_session_timeout = {IDLE_MS}")
        await self._check_trigger()
        self._listener = await psycopg.AsyncConnection.connect(
            self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
        await self._listener.execute(f'LISTEN "{self._channel}"')
        self._listening = asyncio.create_task(self._listen(self._listener),
                                              name=f"coalescer outbox {self._source.name}")

    async def _check_trigger(self) -> None:
        """LookupError while the table does not exist; once it does, a warning (once) if
        it has no trigger."""
        exists, triggers = await (await self._conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL, (SELECT count(*) FROM pg_trigger WHERE "
            "tgrelid = to_regclass(%s) AND NOT tgisinternal)",
            (self._table, self._table))).fetchone()
        if not exists:
            raise LookupError(f"no table {self._source.table} in the database yet: create it "
                              "with coalescer.integrations.sqlalchemy.outbox_ddl or the "
                              "Django migration")
        if not triggers and not self._warned:
            self._warned = True
            log.warning("source %s: table %s has no NOTIFY trigger: rows are found by "
                        "polling, every %gs (create it: coalescer.integrations.sqlalchemy."
                        "outbox_ddl, or the Django migration)", self._source.name,
                        self._source.table, self._source.poll)

    async def _listen(self, conn: Any) -> None:
        try:
            async for _ in conn.notifies():
                self._wake.set()
        except Exception as exc:  # the connection is gone: the next claim reconnects
            log.debug("source %s: LISTEN connection lost: %r", self._source.name, exc)
        self._wake.set()

    async def claim(self, limit: int, up_to: int | None = None) -> list[Row]:
        if self._listening is None or self._listening.done():
            await self.connect()  # LISTEN lost: connect again (and claim what came)
        self._wake.clear()
        await self._conn.execute("BEGIN")
        bound, params = _bound(up_to, "%s")
        cursor = await self._conn.execute(
            f"DELETE FROM {self._table} WHERE id IN (SELECT id FROM {self._table}{bound} "
            f"ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING key, item"
            f"{time_columns(self._source)}", (*params, limit))
        rows = list(await cursor.fetchall())
        self.fields = row_fields(self._source, rows, 2)
        return [(row[0], row[1]) for row in rows]

    async def newest(self) -> int | None:
        cursor = await self._conn.execute(f"SELECT max(id) FROM {self._table}")
        found = await cursor.fetchone()
        return None if found is None or found[0] is None else int(found[0])

    async def done(self) -> None:
        await self._conn.execute("COMMIT")

    async def undo(self) -> None:
        await self._conn.execute("ROLLBACK")

    async def backlog(self) -> Backlog:
        cursor = await self._conn.execute(
            f"SELECT (SELECT count(*) FROM (SELECT 1 FROM {self._table} LIMIT %s) AS t), "
            f"(SELECT EXTRACT(EPOCH FROM clock_timestamp() - created_at) FROM {self._table} "
            "ORDER BY id LIMIT 1)", (COUNT_CAP,))
        rows, lag = await cursor.fetchone()
        return Backlog(int(rows), int(rows) >= COUNT_CAP, max(0.0, float(lag or 0.0)))

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def close(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            await asyncio.gather(self._listening, return_exceptions=True)
            self._listening = None
        for conn in (self._conn, self._listener):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._conn = self._listener = None


class SqliteOutbox(Outbox):
    """An outbox table in a SQLite file: read, touched, then deleted up to the last id."""

    def __init__(self, source: OutboxSource, path: Path) -> None:
        self._source = source
        self._path = path
        self._table = quoted(source.table)
        self._conn: Any = None
        self._last_id: int | None = None
        self._warned = False  # of a table without AUTOINCREMENT: once

    async def connect(self) -> None:
        import aiosqlite

        await self.close()
        if not self._path.exists():  # never create the application's database
            raise FileNotFoundError(f"no SQLite database at {self._path}")
        conn = aiosqlite.connect(self._path, isolation_level=None)
        # its thread never keeps the process from exiting (aiosqlite makes it non-daemon)
        conn._thread.daemon = True
        self._conn = await conn
        await self._conn.execute("PRAGMA busy_timeout = 5000")
        found = await self._first_row(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
            (self._source.table.rsplit(".", 1)[-1],))
        if found is None:
            raise LookupError(f"no table {self._source.table} in {self._path}")
        if "AUTOINCREMENT" not in str(found[0]).upper() and not self._warned:
            self._warned = True
            log.warning("source %s: table %s of %s is not AUTOINCREMENT: SQLite may reuse "
                        "the id of a deleted row, and a row could then be deleted untouched; "
                        "create it with outbox_table() or the Django migration",
                        self._source.name, self._source.table, self._path)

    async def _first_row(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        """The first row of ``sql``, executed and read in one call to aiosqlite's thread.
        A statement stepped once and read on a later turn of the event loop holds
        SQLite's read lock across that turn: an application committing on the same loop
        with a blocking driver then waits for the lock (its busy timeout) while the loop
        waits for it, and its commit fails with "database is locked"."""
        rows = await self._conn.execute_fetchall(sql, params)
        return rows[0] if rows else None

    async def claim(self, limit: int, up_to: int | None = None) -> list[Row]:
        if self._conn is None:
            await self.connect()
        bound, params = _bound(up_to, "?")
        rows = list(await self._conn.execute_fetchall(
            f"SELECT id, key, item{time_columns(self._source)} FROM {self._table}{bound} "
            "ORDER BY id LIMIT ?", (*params, limit)))
        self._last_id = rows[-1][0] if rows else None
        self.fields = row_fields(self._source, rows, 3)
        return [(row[1], row[2]) for row in rows]

    async def newest(self) -> int | None:
        if self._conn is None:
            await self.connect()
        found = await self._first_row(f"SELECT max(id) FROM {self._table}")
        return None if found is None or found[0] is None else int(found[0])

    async def done(self) -> None:
        if self._last_id is not None:
            await self._conn.execute(f"DELETE FROM {self._table} WHERE id <= ?",
                                     (self._last_id,))
        self._last_id = None

    async def undo(self) -> None:
        self._last_id = None

    async def backlog(self) -> Backlog:
        rows, lag = await self._first_row(
            f"SELECT (SELECT count(*) FROM (SELECT 1 FROM {self._table} LIMIT ?)), "
            f"(SELECT (julianday('now') - julianday(created_at)) * 86400 FROM {self._table} "
            "ORDER BY id LIMIT 1)", (COUNT_CAP,))
        return Backlog(int(rows), int(rows) >= COUNT_CAP, max(0.0, float(lag or 0.0)))

    async def wait(self, timeout: float) -> None:
        await asyncio.sleep(timeout)

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
