"""Outbox databases for the tests: a SQLite file or a table of the suite's PostgreSQL
server, created with ``outbox_table``, written with ``touch_in_transaction``."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, MetaData, Table, create_engine, event, func, select
from sqlalchemy.orm import Session

from coalescer.integrations.sqlalchemy import outbox_table, touch_in_transaction
from coalescer.store.keys import KeySpace


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def sqlalchemy_url(url: str) -> str:
    """The suite's libpq URL with SQLAlchemy's psycopg driver named."""
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def make_engine(url: str) -> Engine:
    engine = create_engine(sqlalchemy_url(url))
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def busy(dbapi_connection: Any, record: Any) -> None:
            dbapi_connection.execute("PRAGMA busy_timeout = 10000")
    return engine


@dataclass
class OutboxDb:
    """One outbox table: ``url`` (what the rules file names), its engine and table."""

    kind: str
    url: str
    engine: Engine
    table: Table

    def write(self, keys: Iterable[str], *, rollback: bool = False) -> None:
        """One transaction touching ``keys``; rolled back if told."""
        with Session(self.engine) as session:
            touch_in_transaction(session, *keys, table=self.table)
            if rollback:
                session.rollback()
            else:
                session.commit()

    def rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.table)).scalar_one())

    def source(self, name: str = "orders", **extra: Any) -> str:
        """The ``sources:`` block of a rules file reading this outbox."""
        lines = [f"  - name: {name}", "    type: outbox", f"    url: \"{self.url}\"",
                 f"    table: {self.table.name}"]
        lines += [f"    {field}: {value}" for field, value in extra.items()]
        return "sources:\n" + "\n".join(lines) + "\n"


def new_outbox(kind: str, folder: Path, postgres_url: str | None) -> OutboxDb:
    """A fresh outbox table: in a new SQLite file, or a new table of the server."""
    name = f"outbox_{uuid.uuid4().hex[:10]}"
    url = sqlite_url(folder / f"{name}.db") if kind == "sqlite" else postgres_url
    assert url is not None
    engine = make_engine(url)
    metadata = MetaData()
    table = outbox_table(metadata, name)
    metadata.create_all(engine)
    return OutboxDb(kind=kind, url=url, engine=engine, table=table)


async def pending_keys(redis: Any, namespace: str, rule: str = "customer") -> set[str]:
    """The keys Redis holds as pending for ``rule`` (one shard)."""
    keys = KeySpace(namespace, 1).shard(0)
    return set(await redis.zrange(keys.due(rule), 0, -1))
