"""``await coalescer.drain()`` reads the rules file's sources before it runs what is pending.

Real coalescers (in process) on the suite's valkey-server, with an outbox in a real
SQLite file (or a table of the suite's PostgreSQL server) written by
``touch_in_transaction`` as an application would, and a real Redis Stream written
with XADD. Every rule's window is an hour: a key is refreshed
only because the drain read its source event and ran it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio

from coalescer import Claim, SourceReadError
from coalescer.store.keys import sources_rejected
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.outbox import OutboxDb, new_outbox
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    window: 1h
    max_wait: 2h
    handler: {{mod}}:refresh
"""


def setup(tmp_path: Path, namespace: str, sources: str) -> tuple[Path, Recorder]:
    text = RULES.format(ns=namespace) + sources
    return recorder_rules(tmp_path, f"drain_sources_{namespace}", text)


def keys_of(claims: list[Claim]) -> list[str]:
    return [claim.key for claim in claims]


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[OutboxDb]:
    yield from _outbox("sqlite", tmp_path, None)


def _outbox(kind: str, tmp_path: Path, url: str | None) -> Iterator[OutboxDb]:
    db = new_outbox(kind, tmp_path, url)
    yield db
    db.table.drop(db.engine)
    db.engine.dispose()


@pytest.fixture(params=[("sqlite", False), ("sqlite", True), ("postgresql", False)],
                ids=["sqlite-write-only", "sqlite-worker", "postgresql-write-only"])
def outbox_case(request: pytest.FixtureRequest, tmp_path: Path
                ) -> Iterator[tuple[OutboxDb, bool]]:
    """An outbox of each kind, and whether the coalescer is a worker."""
    kind, worker = request.param
    url = request.getfixturevalue("postgres").url if kind == "postgresql" else None
    for db in _outbox(kind, tmp_path, url):
        yield db, worker


async def test_drain_touches_and_runs_the_outbox_rows_and_deletes_them(
        tmp_path: Path, namespace: str, redis_url: str,
        outbox_case: tuple[OutboxDb, bool], start: Start) -> None:
    db, worker = outbox_case
    path, rec = setup(tmp_path, namespace, db.source(poll="1m"))  # the loop looks rarely
    c = await start(path, redis_url=redis_url, worker=worker)
    db.write(["stats:customer:1", "stats:customer:2"])
    db.write(["stats:customer:1"])
    db.write(["stats:customer:3"], rollback=True)

    claims = await c.drain(timeout=20)

    assert sorted(keys_of(claims)) == ["stats:customer:1", "stats:customer:2"]
    assert sorted(keys_of(rec.calls)) == ["stats:customer:1", "stats:customer:2"]
    assert db.rows() == 0  # touched, then deleted: never read twice
    assert await c.drain(timeout=5) == []


async def test_a_drain_told_to_leave_the_sources_unread_runs_only_what_is_pending(
        tmp_path: Path, namespace: str, redis_url: str, sqlite_db: OutboxDb,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace, sqlite_db.source(poll="1m"))
    c = await start(path, redis_url=redis_url, worker=False)
    sqlite_db.write(["stats:customer:1"])
    c.touch("stats:customer:2")

    claims = await c.drain(timeout=20, sources=False)

    assert keys_of(claims) == ["stats:customer:2"]
    assert sqlite_db.rows() == 1  # left for a node, or the next drain
    assert keys_of(await c.drain(timeout=20)) == ["stats:customer:1"]


async def test_outbox_rows_a_handler_writes_are_drained_in_the_next_round(
        tmp_path: Path, namespace: str, redis_url: str, sqlite_db: OutboxDb,
        start: Start) -> None:
    db = sqlite_db
    path, rec = setup(tmp_path, namespace, db.source(poll="1m"))

    async def order_placed(claim: Claim) -> None:
        if claim.key == "stats:customer:1":  # its refresh writes another row
            db.write(["stats:customer:2"])

    rec.hook = order_placed
    c = await start(path, redis_url=redis_url, worker=False)
    db.write(["stats:customer:1"])

    claims = await c.drain(timeout=20)

    assert keys_of(claims) == ["stats:customer:1", "stats:customer:2"]
    assert db.rows() == 0


async def test_drain_reads_the_stream_entries_and_acknowledges_them(
        tmp_path: Path, namespace: str, redis_url: str, start: Start,
        redis_client: redis.asyncio.Redis) -> None:
    stream = f"{namespace}:orders"
    sources = (f"sources:\n  - name: order-events\n    stream: \"{stream}\"\n"
               "    start: all\n    key: \"stats:customer:{customer_id}\"\n")
    path, _ = setup(tmp_path, namespace, sources)
    for customer in ("7", "8", "7", "bad:id"):
        await redis_client.xadd(stream, {"customer_id": customer})
    c = await start(path, redis_url=redis_url, worker=False)

    claims = await c.drain(timeout=20)

    assert sorted(keys_of(claims)) == ["stats:customer:7", "stats:customer:8"]
    (group,) = await redis_client.xinfo_groups(stream)
    assert (group["pending"], group["lag"]) == (0, 0)  # each entry acknowledged once
    assert await redis_client.hget(sources_rejected(namespace), "order-events") == "1"
    assert await c.drain(timeout=5) == []


async def test_a_workers_drain_reads_its_running_sources_each_event_once(
        tmp_path: Path, namespace: str, redis_url: str, sqlite_db: OutboxDb,
        start: Start) -> None:
    stream = f"{namespace}:orders"
    sources = (sqlite_db.source(poll="1m") + f"  - name: order-events\n"
               f"    stream: \"{stream}\"\n    key: \"stats:customer:{{customer_id}}\"\n")
    path, _ = setup(tmp_path, namespace, sources)
    c = await start(path, redis_url=redis_url, worker=True)
    redis_client = c.redis
    await wait_until(lambda: redis_client.exists(stream), message="the stream's group")
    sqlite_db.write(["stats:customer:1"])
    for customer in ("7", "8", "7"):  # the running loop reads them as they come
        await redis_client.xadd(stream, {"customer_id": customer})

    claims = await c.drain(timeout=20)

    assert sorted(keys_of(claims)) == ["stats:customer:1", "stats:customer:7",
                                       "stats:customer:8"]
    accepted = {source: c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": source, "outcome": "accepted"})
        for source in ("orders", "order-events")}
    assert accepted == {"orders": 1, "order-events": 3}  # each event touched once
    (group,) = await redis_client.xinfo_groups(stream)
    assert (group["pending"], group["lag"]) == (0, 0)
    assert sqlite_db.rows() == 0


async def test_a_source_that_cannot_be_read_fails_the_drain_naming_it(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    missing = tmp_path / "gone.db"
    sources = (f"sources:\n  - name: orders\n    type: outbox\n"
               f"    url: \"sqlite:///{missing}\"\n")
    path, rec = setup(tmp_path, namespace, sources)
    c = await start(path, redis_url=redis_url, worker=False)
    c.touch("stats:customer:1")

    with pytest.raises(SourceReadError) as info:
        await c.drain(timeout=10)

    assert info.value.source == "orders"
    message = str(info.value)
    assert "source 'orders'" in message and f"no SQLite database at {missing}" in message
    assert rec.calls == []


async def test_a_database_that_never_answers_fails_the_drain_at_its_timeout(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    held: list[asyncio.StreamWriter] = []

    async def mute(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepts the connection, never says a word

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sources = (f"sources:\n  - name: orders\n    type: outbox\n"
               f"    url: \"postgresql://app@127.0.0.1:{port}/shop\"\n")
    path, rec = setup(tmp_path, namespace, sources)
    c = await start(path, redis_url=redis_url, worker=False)
    try:
        with pytest.raises(SourceReadError) as info:
            await c.drain(timeout=1)
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()

    assert info.value.source == "orders"
    assert f"source 'orders' (outbox coalescer_outbox at postgresql://app@127.0.0.1:{port}" \
        f"/shop) could not be read before the deadline" in str(info.value)
    assert rec.calls == []
