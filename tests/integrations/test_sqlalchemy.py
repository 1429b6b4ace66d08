"""Touch after commit with SQLAlchemy: a real SQLite database, a real server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

from coalescer import ClosedError, Coalescer, InvalidKeyError, UnknownKeyError
from coalescer.integrations.sqlalchemy import touch_after_commit
from coalescer.testing import assert_refreshed

# Default settings: a 2s window (drain skips it), concurrency 16, 5 attempts.
RULES = """\
namespace: {ns}
rules:
  - name: user
    match: "stats:user:{{id}}"
    handler: builtins:id
"""

RulesFactory = Callable[..., Path]


def sqlite_engine(path: Path) -> Engine:
    """SQLite with real savepoints: pysqlite's own transaction handling is turned off
    and SQLAlchemy emits BEGIN (the recipe of SQLAlchemy's SQLite documentation)."""
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def no_driver_transactions(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = sqlite_engine(tmp_path / "app.db")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (user_id INTEGER, amount INTEGER)"))
    return engine


@pytest_asyncio.fixture
async def c(rules_file: RulesFactory, namespace: str, redis_url: str) -> AsyncIterator[Coalescer]:
    async with Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)), redis_url=redis_url,
                                   worker=False) as coalescer:
        yield coalescer


def place(session: Session, c: Coalescer, user_id: int) -> None:
    session.execute(text("INSERT INTO orders VALUES (:u, 10)"), {"u": user_id})
    touch_after_commit(session, c, f"stats:user:{user_id}")


def orders(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [row[0] for row in conn.execute(text("SELECT user_id FROM orders"))]


async def test_keys_are_touched_once_the_transaction_commits(engine: Engine,
                                                             c: Coalescer) -> None:
    with Session(engine) as session:
        place(session, c, 1)
        place(session, c, 1)
        place(session, c, 2)
        assert await c.drain() == []  # not committed yet: nothing touched
        session.commit()
    assert_refreshed(await c.drain(), ["stats:user:1", "stats:user:2"], exactly_once=True)
    assert orders(engine) == [1, 1, 2]


async def test_keys_of_a_rolled_back_transaction_are_dropped(engine: Engine,
                                                             c: Coalescer) -> None:
    with Session(engine) as session:
        place(session, c, 1)
        session.rollback()
        place(session, c, 2)  # the next transaction of the same session
        session.commit()
    assert_refreshed(await c.drain(), ["stats:user:2"])
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        place(session, c, 3)
        raise RuntimeError("the request failed")
    assert await c.drain() == []
    assert orders(engine) == [2]


async def test_a_rolled_back_savepoint_drops_only_its_keys(engine: Engine,
                                                           c: Coalescer) -> None:
    with Session(engine) as session, session.begin():
        place(session, c, 1)
        with pytest.raises(ValueError), session.begin_nested():
            place(session, c, 2)
            with session.begin_nested():  # released, but inside the rolled-back one
                place(session, c, 3)
            raise ValueError("undo 2 and 3")
        with session.begin_nested():  # released: its keys join the outer transaction
            place(session, c, 4)
        assert await c.drain() == []
    assert_refreshed(await c.drain(), ["stats:user:1", "stats:user:4"], exactly_once=True)
    assert sorted(orders(engine)) == [1, 4]


async def test_a_released_savepoint_of_a_rolled_back_transaction_touches_nothing(
        engine: Engine, c: Coalescer) -> None:
    with Session(engine) as session:
        session.begin()
        with session.begin_nested():
            place(session, c, 1)
        session.begin_nested()
        place(session, c, 2)
        session.rollback()  # the outermost, with a savepoint still open
    assert await c.drain() == []
    assert orders(engine) == []


async def test_closing_a_session_uncommitted_touches_nothing(engine: Engine,
                                                             c: Coalescer) -> None:
    session = Session(engine)
    place(session, c, 1)
    session.close()
    assert await c.drain() == []


async def test_outside_a_transaction_keys_are_touched_at_once(engine: Engine,
                                                              c: Coalescer) -> None:
    with Session(engine) as session:
        assert session.get_transaction() is None  # nothing begun, nothing uncommitted
        touch_after_commit(session, c, "stats:user:7")
        assert_refreshed(await c.drain(), ["stats:user:7"])
        session.commit()  # nothing left to touch
    assert await c.drain() == []


async def test_a_key_that_could_never_be_touched_is_refused_at_the_call(
        engine: Engine, c: Coalescer) -> None:
    with Session(engine) as session:
        place(session, c, 1)
        with pytest.raises(UnknownKeyError, match=r"no rule in .* matches key 'orders:1'"):
            touch_after_commit(session, c, "stats:user:2", "orders:1")
        with pytest.raises(InvalidKeyError):
            touch_after_commit(session, c, "stats:user:\0")
        session.commit()
    assert_refreshed(await c.drain(), ["stats:user:1"])  # the refused calls added nothing


async def test_a_touch_that_fails_at_commit_is_raised_after_the_commit(
        engine: Engine, rules_file: RulesFactory, namespace: str, redis_url: str,
        c: Coalescer) -> None:
    gone = Coalescer.from_yaml(rules_file(RULES.format(ns=namespace)), redis_url=redis_url,
                               worker=False)
    await gone.start()
    with Session(engine) as session:
        place(session, gone, 1)
        touch_after_commit(session, c, "stats:user:2")
        await gone.close()
        with pytest.raises(ClosedError, match="touch"):
            session.commit()
    assert orders(engine) == [1]  # committed all the same
    assert_refreshed(await c.drain(), ["stats:user:2"])  # the other coalescer's keys


async def test_an_async_session_touches_after_its_commit(tmp_path: Path, engine: Engine,
                                                         c: Coalescer) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    try:
        async with AsyncSession(async_engine) as session:
            await session.execute(text("INSERT INTO orders VALUES (1, 10)"))
            touch_after_commit(session, c, "stats:user:1")
            await session.rollback()
            await session.execute(text("INSERT INTO orders VALUES (2, 10)"))
            touch_after_commit(session, c, "stats:user:2")
            assert await c.drain() == []
            await session.commit()
        assert_refreshed(await c.drain(), ["stats:user:2"], exactly_once=True)
        assert orders(engine) == [2]
    finally:
        await async_engine.dispose()
