"""Touches written as outbox rows in a SQLAlchemy transaction: real SQLite and PostgreSQL.

Checks what the database holds after each way a transaction can end (commit, rollback,
savepoints released or rolled back, a session closed uncommitted), how many INSERT
statements a transaction cost, and the keys refused at the call.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, create_engine, event, select, text
from sqlalchemy.orm import Session

from coalescer import InvalidItemError, InvalidKeyError, UnknownKeyError
from coalescer.config.rules import Config
from coalescer.integrations.outbox_sqlalchemy import pending_rows
from coalescer.integrations.sqlalchemy import outbox_ddl, outbox_table, touch_in_transaction
from tests.integrations.test_sqlalchemy import sqlite_engine

RULES = Config.from_string("rules:\n  - {name: user, match: 'stats:user:{id}', "
                           "handler: builtins:id}\n")


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        found = sqlite_engine(tmp_path / "app.db")
    else:
        server = request.getfixturevalue("postgres")
        found = create_engine(server.url.replace("postgresql://", "postgresql+psycopg://"))
    yield found
    found.dispose()


@pytest.fixture
def table(engine: Engine) -> Any:
    metadata = MetaData()
    created = outbox_table(metadata, f"outbox_{uuid.uuid4().hex[:10]}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS orders (user_id INTEGER)"))
    metadata.create_all(engine)
    return created


def rows(engine: Engine, table: Any) -> list[tuple[str, str | None]]:
    with engine.connect() as conn:
        return [(r.key, r.item) for r in conn.execute(select(table).order_by(table.c.id))]


def count_inserts(engine: Engine, table: Any) -> list[str]:
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO") and table.name in statement:
            seen.append(statement)

    return seen


def place(session: Session, table: Any, user_id: int, **kw: Any) -> None:
    session.execute(text("INSERT INTO orders VALUES (:u)"), {"u": user_id})
    touch_in_transaction(session, f"stats:user:{user_id}", table=table, **kw)


def test_a_transaction_writes_its_touches_in_one_insert(engine: Engine, table: Any) -> None:
    inserts = count_inserts(engine, table)
    with Session(engine) as session:
        for n in range(50):
            place(session, table, n % 20)
        touch_in_transaction(session, "stats:user:x", "stats:user:y", table=table,
                             item="order-7")
        assert rows(engine, table) == []  # nothing written before the commit
        assert pending_rows(session) == 22
        session.commit()
    assert len(inserts) == 1
    assert rows(engine, table) == [(f"stats:user:{n}", None) for n in range(20)] + [
        ("stats:user:x", "order-7"), ("stats:user:y", "order-7")]


def test_a_rolled_back_transaction_touches_nothing(engine: Engine, table: Any) -> None:
    with Session(engine) as session:
        place(session, table, 1)
        session.rollback()
        place(session, table, 2)  # the session's next transaction
        session.commit()
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        place(session, table, 3)
        raise RuntimeError("the request failed")
    session = Session(engine)
    place(session, table, 4)
    session.close()  # never committed
    assert rows(engine, table) == [("stats:user:2", None)]


def test_savepoints_keep_or_drop_their_touches(engine: Engine, table: Any) -> None:
    inserts = count_inserts(engine, table)
    with Session(engine) as session, session.begin():
        place(session, table, 1)
        with pytest.raises(ValueError), session.begin_nested():
            place(session, table, 2)
            with session.begin_nested():  # released, inside the rolled-back one
                place(session, table, 3)
            raise ValueError("undo 2 and 3")
        with session.begin_nested():  # released: its touches join the transaction
            place(session, table, 4)
        place(session, table, 5)
    assert sorted(rows(engine, table)) == [(f"stats:user:{n}", None) for n in (1, 4, 5)]
    # the inner release writes 3 and its parent's 2 (undone with it); the next release
    # writes 4 and the transaction's 1; the commit writes 5
    assert len(inserts) == 3


def test_the_outer_transactions_touches_survive_a_rolled_back_inner_savepoint(
        engine: Engine, table: Any) -> None:
    with Session(engine) as session, session.begin():
        place(session, table, 1)
        outer = session.begin_nested()
        place(session, table, 2)
        with session.begin_nested():
            place(session, table, 3)  # written inside this one, landing in the outer
        outer.rollback()
        place(session, table, 4)
    assert sorted(rows(engine, table)) == [("stats:user:1", None), ("stats:user:4", None)]


def test_committing_the_outer_transaction_with_a_savepoint_open_writes_all(
        engine: Engine, table: Any) -> None:
    session = Session(engine)
    outer = session.begin()
    place(session, table, 1)
    session.begin_nested()
    place(session, table, 2)
    session.begin_nested()
    place(session, table, 3)
    outer.commit()  # commits the savepoints on its way
    session.close()
    assert sorted(rows(engine, table)) == [(f"stats:user:{n}", None) for n in (1, 2, 3)]


def test_keys_are_checked_at_the_call(engine: Engine, table: Any) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidKeyError):
            touch_in_transaction(session, "stats:user:1", "bad\0key", table=table)
        with pytest.raises(UnknownKeyError, match="orders:1"):
            touch_in_transaction(session, "stats:user:1", "orders:1", table=table,
                                 rules=RULES)
        with pytest.raises(InvalidItemError, match="NUL character"):
            touch_in_transaction(session, "stats:user:1", table=table, item="x\0")
        with pytest.raises(InvalidItemError, match="must not be empty"):
            touch_in_transaction(session, "stats:user:1", table=table, item="")
        with pytest.raises(InvalidItemError, match="takes no items"):
            touch_in_transaction(session, "stats:user:1", table=table, item="x", rules=RULES)
        touch_in_transaction(session, "orders:1", table=table)  # no rules: the node decides
        touch_in_transaction(session, table=table)  # nothing to touch
        session.commit()
    assert rows(engine, table) == [("orders:1", None)]


async def test_an_async_session_writes_its_touches_at_commit(tmp_path: Path) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = sqlite_engine(tmp_path / "app.db")
    metadata = MetaData()
    table = outbox_table(metadata)
    metadata.create_all(engine)
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    try:
        async with AsyncSession(async_engine) as session:
            touch_in_transaction(session, "stats:user:1")
            await session.rollback()
            touch_in_transaction(session, "stats:user:2", "stats:user:3")
            await session.commit()
    finally:
        await async_engine.dispose()
    assert rows(engine, table) == [("stats:user:2", None), ("stats:user:3", None)]


def test_the_sqlite_table_never_reuses_an_id(tmp_path: Path) -> None:
    engine = sqlite_engine(tmp_path / "app.db")
    metadata = MetaData()
    outbox_table(metadata)
    metadata.create_all(engine)
    with engine.connect() as conn:
        sql = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = "
                                "'coalescer_outbox'")).scalar_one()
    assert "AUTOINCREMENT" in sql


def test_postgres_gets_a_notify_trigger(postgres: Any) -> None:
    engine = create_engine(postgres.url.replace("postgresql://", "postgresql+psycopg://"))
    metadata = MetaData()
    table = outbox_table(metadata, "outbox_trigger_test", schema="public")
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            for statement in outbox_ddl(table):  # idempotent: a migration may run it again
                conn.exec_driver_sql(statement)
            found = conn.execute(text("SELECT tgname FROM pg_trigger WHERE tgrelid = "
                                      "'public.outbox_trigger_test'::regclass")).scalars()
            assert list(found) == ["outbox_trigger_test_notify"]
    finally:
        metadata.drop_all(engine)
        engine.dispose()
