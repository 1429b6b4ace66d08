"""The outbox's guarantee, tested by killing things.

Writer processes commit a row and SIGKILL themselves the moment the commit returns:
with ``touch_in_transaction`` no touch is lost (the node reads them from the table
afterwards); with ``touch_after_commit`` the touches still in the writer's buffer die
with it (counted, printed). A node SIGKILLed while it holds claimed rows loses none:
another node takes them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
import redis.asyncio
from sqlalchemy import text
from sqlalchemy.orm import Session

from bench.postgres import PostgresServer
from coalescer import Coalescer, SyncCoalescer
from coalescer.integrations.sqlalchemy import touch_after_commit, touch_in_transaction
from tests.helpers.e2e import NodeProcs
from tests.helpers.forks import exit_code, in_child
from tests.helpers.outbox import OutboxDb, make_engine, new_outbox, pending_keys
from tests.helpers.servers import ValkeyProcess, wait_until

WRITERS = 30

RULES = """\
namespace: {ns}
claim_lease: 1s
defaults: {{window: 1h, max_wait: 1h}}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: builtins:repr
"""


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[Any]:
    async with AsyncExitStack() as stack:
        async def make(path: Path, url: str, **options: Any) -> Coalescer:
            c = Coalescer.from_yaml(path, redis_url=url, grace=2.0, **options)
            await stack.enter_async_context(c)
            return c

        yield make


def write_rules(tmp_path: Path, namespace: str, outbox: OutboxDb | None, **extra: Any) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace) + (outbox.source(**extra) if outbox else ""))
    return path


def killed_writers(body: Callable[[int], None]) -> list[int]:
    """Fork WRITERS writers, each running ``body(n)`` then SIGKILLing itself at once;
    their exit codes once every one has died."""
    def writer(n: int) -> Callable[[], None]:
        def run() -> None:
            body(n)
            os.kill(os.getpid(), signal.SIGKILL)  # the moment the commit returned
        return run
    pids = [in_child(writer(n)) for n in range(WRITERS)]
    return [exit_code(pid) for pid in pids]


def order_table(outbox: OutboxDb) -> None:
    with outbox.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS orders (customer_id TEXT)"))
    outbox.engine.dispose()  # the writers open connections of their own


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_writers_killed_after_commit_lose_no_touch_with_the_outbox(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        request: pytest.FixtureRequest, kind: str) -> None:
    server = request.getfixturevalue("postgres") if kind == "postgresql" else None
    outbox = new_outbox(kind, tmp_path, server.url if server else None)
    order_table(outbox)

    def commit(n: int) -> None:
        engine = make_engine(outbox.url)
        with Session(engine) as session:
            session.execute(text("INSERT INTO orders VALUES (:c)"), {"c": str(n)})
            touch_in_transaction(session, f"stats:customer:{n}", table=outbox.table)
            session.commit()

    assert killed_writers(commit) == [-signal.SIGKILL] * WRITERS
    assert outbox.rows() == WRITERS  # every touch committed with its order
    c = await nodes(write_rules(tmp_path, namespace, outbox, poll="50ms"), redis_url)
    await wait_until(lambda: outbox.rows() == 0, timeout=20)
    found = await pending_keys(redis_client, namespace)
    lost = WRITERS - len(found)
    print(f"\noutbox ({kind}): {lost} of {WRITERS} touches lost by writers SIGKILLed "
          "right after commit")
    assert lost == 0
    assert c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": "orders", "outcome": "accepted"}) == WRITERS


def test_writers_killed_after_commit_lose_touches_with_touch_after_commit(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    outbox = new_outbox("sqlite", tmp_path, None)  # only its orders table is used here
    order_table(outbox)
    rules = write_rules(tmp_path, namespace, None)

    def commit(n: int) -> None:
        engine = make_engine(outbox.url)
        with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as c, Session(engine) as s:
            s.execute(text("INSERT INTO orders VALUES (:c)"), {"c": str(n)})
            touch_after_commit(s, c, f"stats:customer:{n}")
            s.commit()
            os.kill(os.getpid(), signal.SIGKILL)  # before the context's clean flush

    assert killed_writers(commit) == [-signal.SIGKILL] * WRITERS
    with outbox.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM orders")).scalar_one() == WRITERS
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        from coalescer.store.keys import KeySpace
        found = client.zrange(KeySpace(namespace, 1).shard(0).due("customer"), 0, -1)
    finally:
        client.close()
    lost = WRITERS - len(found)
    print(f"\ntouch_after_commit: {lost} of {WRITERS} touches lost by writers SIGKILLed "
          "right after commit")
    assert lost > 0  # the hole the outbox closes (30 of 30 where measured)


def locked_rows(url: str, table: str) -> tuple[int, int]:
    """Rows in the table, and how many of them no one holds (lockable now)."""
    with psycopg.connect(url, autocommit=False) as conn:
        total = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
        free = conn.execute(f'SELECT count(*) FROM (SELECT 1 FROM "{table}" '
                            "FOR UPDATE SKIP LOCKED) AS t").fetchone()
        conn.rollback()
    assert total is not None and free is not None
    return int(total[0]), int(free[0])


async def test_a_node_killed_while_holding_rows_loses_none(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, nodes: Any, *,
        postgres: PostgresServer) -> None:
    outbox = new_outbox("postgresql", tmp_path, postgres.url)
    rules = write_rules(tmp_path, namespace, outbox, poll="50ms")
    procs = NodeProcs(tmp_path)
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        node = procs.start(rules, own_server.url, "doomed")
        await wait_until(lambda: client.hlen(f"{namespace}:{{{namespace}:sources}}:outbox"),
                         timeout=30, message="the node reading the outbox")
        assert own_server.proc is not None
        own_server.proc.send_signal(signal.SIGSTOP)  # its flush now waits for an answer
        try:
            outbox.write([f"stats:customer:{n}" for n in range(50)])
            await wait_until(lambda: locked_rows(postgres.url, outbox.table.name) == (50, 0),
                             timeout=45, message="the node holding every row")
            node.send_signal(signal.SIGKILL)
            node.wait()
        finally:
            own_server.proc.send_signal(signal.SIGCONT)
        c = await nodes(rules, own_server.url, node_id="survivor")
        await wait_until(lambda: outbox.rows() == 0, timeout=30, message="rows taken over")
        assert await pending_keys(client, namespace) >= {f"stats:customer:{n}"
                                                         for n in range(50)}
        assert c.metrics.registry.get_sample_value(
            "coalescer_source_entries_total", {"source": "orders", "outcome": "accepted"}) == 50
    finally:
        procs.stop_all()
        await client.aclose()
        outbox.table.drop(outbox.engine)
        outbox.engine.dispose()


async def test_a_claim_whose_connection_dies_before_its_commit_is_claimed_again(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, nodes: Any, *,
        postgres: PostgresServer) -> None:
    outbox = new_outbox("postgresql", tmp_path, postgres.url)
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        c = await nodes(write_rules(tmp_path, namespace, outbox, poll="50ms"), own_server.url)
        await wait_until(lambda: client.hlen(f"{namespace}:{{{namespace}:sources}}:outbox"))
        assert own_server.proc is not None
        own_server.proc.send_signal(signal.SIGSTOP)  # the node's flush waits, rows held
        try:
            outbox.write([f"stats:customer:{n}" for n in range(10)])
            await wait_until(lambda: locked_rows(postgres.url, outbox.table.name) == (10, 0),
                             timeout=20, message="the node holding every row")
            with psycopg.connect(postgres.url, autocommit=True) as admin:
                ended = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE state = 'idle in transaction' AND query LIKE 'DELETE FROM%'"
                ).fetchall()
            assert ended == [(True,)]
        finally:
            own_server.proc.send_signal(signal.SIGCONT)  # the flush ends; the commit fails
        await wait_until(lambda: outbox.rows() == 0, timeout=30, message="claimed again")
        assert await pending_keys(client, namespace) == {f"stats:customer:{n}"
                                                         for n in range(10)}
        assert c.metrics.registry.get_sample_value(
            "coalescer_outbox_errors_total", {"source": "orders"}) >= 1
    finally:
        await client.aclose()
        outbox.table.drop(outbox.engine)
        outbox.engine.dispose()
