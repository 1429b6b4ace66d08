"""Touches written as rows of an outbox table, in a SQLAlchemy session's transaction.

``outbox_table(metadata)`` adds the outbox table to the application's metadata (with,
on PostgreSQL, a trigger that NOTIFYs the coalescer nodes when rows commit);
``touch_in_transaction(session, *keys)`` records touches on the session's current
transaction, written just before it commits as one multi-row ``INSERT``. Savepoints,
``AsyncSession`` and the checks at the call: docs/sources.md, "Writing touches:
SQLAlchemy".
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Column,
    DateTime,
    Identity,
    Integer,
    MetaData,
    Table,
    Text,
    event,
    func,
    insert,
)
from sqlalchemy.orm import Session, SessionTransaction

from coalescer.integrations.outbox_rows import (
    DEFAULT_TABLE,
    ROWS_PER_INSERT,
    checked_rows,
    postgres_ddl,
)

__all__ = ["DEFAULT_TABLE", "outbox_ddl", "outbox_table", "touch_in_transaction"]

_STATE = "coalescer.touch_in_transaction"

Row = tuple[str, str | None]


def outbox_table(metadata: MetaData, name: str = DEFAULT_TABLE, *,
                 schema: str | None = None, notify: bool = True) -> Table:
    """The outbox table, added to ``metadata``: ``id`` (a growing bigint), ``key``,
    ``item`` (nullable) and ``created_at``. ``metadata.create_all`` creates it and, on
    PostgreSQL, the NOTIFY trigger that wakes the nodes at once (unless ``notify`` is
    false: each transaction is then cheaper, and the nodes find rows by polling); with
    migrations (Alembic), run ``outbox_ddl(table)`` after creating the table."""
    table = Table(
        name, metadata,
        Column("id", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True),
        Column("key", Text, nullable=False),
        Column("item", Text, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False,
               server_default=func.current_timestamp()),
        schema=schema,
        sqlite_autoincrement=True,  # SQLite never reuses the id of a deleted row
    )
    for statement in outbox_ddl(table) if notify else ():
        ddl = DDL(statement)  # type: ignore[no-untyped-call]
        event.listen(table, "after_create", ddl.execute_if(dialect="postgresql"))
    return table


def outbox_ddl(table: Table) -> list[str]:
    """The PostgreSQL statements that make ``table`` NOTIFY the nodes once per committing
    transaction that inserted rows (a trigger function and a statement-level trigger);
    idempotent. For a migration: ``for sql in outbox_ddl(table): op.execute(sql)``."""
    return postgres_ddl(table.name, table.schema)


_DEFAULT = outbox_table(MetaData())


def touch_in_transaction(session: Any, *keys: str, item: str | None = None,
                         table: Table | None = None, rules: Any = None) -> None:
    """Record touches of ``keys`` (with ``item``, if given) as outbox rows of ``session``'s
    transaction, written just before it commits; rolled back with it.

    Every key is checked at the call, as ``touch()`` checks it: InvalidKeyError for a
    key Redis cannot store; with ``rules`` (a ``Config``, ``Coalescer`` or
    ``SyncCoalescer``) UnknownKeyError for a key that no rule matches too. Without
    ``rules`` the node that reads the outbox rejects such a key (counted, logged, never
    blocking the others). Like any statement, the call begins the session's transaction
    if none is begun. ``table``: the outbox's ``Table`` when it is not named
    ``coalescer_outbox`` in the default schema.
    """
    rows = checked_rows(keys, item, rules)
    if not rows:
        return
    session = getattr(session, "sync_session", session)  # an AsyncSession
    current = innermost(session) or session.begin()
    buffers = _buffers(session)
    pending = buffers.setdefault(current, {}).setdefault(
        table if table is not None else _DEFAULT, {})
    pending.update(dict.fromkeys(rows))


Buffers = dict[SessionTransaction, dict[Table, dict[Row, None]]]


def pending_rows(session: Any) -> int:
    """How many distinct touches ``session`` holds, not yet written (for tests)."""
    session = getattr(session, "sync_session", session)
    buffers: Buffers = session.info.get(_STATE, {})
    return sum(len(rows) for tables in buffers.values() for rows in tables.values())


def innermost(session: Session) -> SessionTransaction | None:
    """The session's innermost transaction (a SAVEPOINT's, else its own), if any."""
    return session.get_nested_transaction() or session.get_transaction()


def _buffers(session: Session) -> Buffers:
    buffers = session.info.get(_STATE)
    if buffers is None:
        buffers = session.info[_STATE] = {}
        event.listen(session, "before_commit", _before_commit)
        event.listen(session, "after_transaction_end", _after_transaction_end)
    assert isinstance(buffers, dict)
    return buffers


def _before_commit(session: Session) -> None:
    """Write the touches of the innermost transaction and of its parent, inside it.

    The innermost one commits in every case (its own release, or an enclosing
    transaction committing it on the way): what it holds commits into its parent,
    so the parent's touches are as safe there. Higher ones wait for a commit closer
    to them, so a savepoint rolled back between never takes them along.
    """
    current = innermost(session)
    if current is None:
        return
    buffers: Buffers = session.info.get(_STATE, {})
    merged: dict[Table, dict[Row, None]] = {}
    for transaction in (current, current.parent):
        for table, rows in buffers.pop(transaction, {}).items() if transaction else ():
            merged.setdefault(table, {}).update(rows)
    for table, rows in merged.items():
        _insert(session, table, list(rows))


def _insert(session: Session, table: Table, rows: list[Row]) -> None:
    if len(rows) == 1:  # the common case, as a statement SQLAlchemy compiles once
        session.execute(insert(table), {"key": rows[0][0], "item": rows[0][1]})
        return
    for start in range(0, len(rows), ROWS_PER_INSERT):
        chunk = rows[start:start + ROWS_PER_INSERT]
        session.execute(insert(table).values([{"key": k, "item": i} for k, i in chunk]))


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    # Touches still held by a transaction that ended were never written: it rolled
    # back, or closed uncommitted. They are dropped with it.
    buffers: Buffers = session.info.get(_STATE, {})
    buffers.pop(transaction, None)

