"""A PostgreSQL outbox table that does not exist yet is said to be missing, once; the
table's NOTIFY trigger is looked for only once the table exists."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text

from bench.postgres import PostgresServer
from tests.conftest import Start
from tests.helpers.outbox import make_engine
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: builtins:repr
sources:
  - {{name: orders, type: outbox, url: '{url}', table: {table}, poll: 50ms}}
"""


async def test_a_missing_table_is_said_once_and_its_trigger_looked_for_once_it_exists(
        rules_file: Callable[..., Path], namespace: str, redis_url: str, start: Start, *,
        postgres: PostgresServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources")
    table = f"late_{namespace}"
    path = rules_file(RULES.format(ns=namespace, url=postgres.url, table=table))
    c = await start(path, redis_url=redis_url)

    def said(words: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if words in r.getMessage()]

    missing = f"no table {table} in the database yet: create it with "
    await wait_until(lambda: said(missing), timeout=20)
    engine = make_engine(postgres.url)
    try:
        with engine.begin() as conn:  # made by hand: no NOTIFY trigger
            conn.execute(text(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, key TEXT NOT "
                              "NULL, item TEXT, created_at TIMESTAMP DEFAULT now())"))
            conn.execute(text(f"INSERT INTO {table} (key) VALUES ('stats:customer:1')"))

        async def touched() -> bool:
            explained = await c.query.explain("stats:customer:1")
            return bool(explained["state"] == "pending")
        await wait_until(touched, timeout=20)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()
    assert len(said(missing)) == 1
    (trigger,) = said("has no NOTIFY trigger")
    messages = [r.getMessage() for r in caplog.records]
    assert messages.index(said(missing)[0]) < messages.index(trigger)
