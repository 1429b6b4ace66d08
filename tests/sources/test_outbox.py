"""Outbox sources: rows written in the application's transactions become touches.

The rules-file part runs without servers. The rest runs real coalescer nodes (in
process) on real valkey-servers, reading a real SQLite file or a table of the suite's
PostgreSQL server, written with ``touch_in_transaction`` as an application would; the
refresh window is an hour, so every touched key stays pending in Redis, where the
tests look for it.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio
from sqlalchemy import MetaData, text
from sqlalchemy.orm import Session

from bench.postgres import PostgresServer
from coalescer import Coalescer
from coalescer.config.rules import Config, check_file
from coalescer.errors import ConfigError
from coalescer.integrations.sqlalchemy import outbox_table, touch_in_transaction
from coalescer.query.source_status import format_sources
from coalescer.sources.base import SOURCE_TYPES
from coalescer.sources.outbox import OutboxSources, check_outbox, open_outboxes, outbox_status
from coalescer.sources.outbox_db import Backlog, open_outbox
from coalescer.store.keys import sources_outbox
from tests.helpers.outbox import OutboxDb, make_engine, new_outbox, pending_keys
from tests.helpers.servers import ValkeyProcess, wait_until

# -- the rules file ---------------------------------------------------------------------

BASE = """\
rules:
  - name: customer
    match: "stats:customer:{id}"
    handler: builtins:repr
"""


def load(sources: str) -> Config:
    return Config.from_string(BASE + sources, source="rules.yaml")


def test_an_outbox_source_gets_its_defaults() -> None:
    config = load("sources:\n  - name: orders\n    type: outbox\n"
                  "    url: postgresql+psycopg://app:secret@127.0.0.1/shop\n")
    (source,) = config.sources
    assert (source.name, source.type, source.table, source.batch, source.poll, source.line) \
        == ("orders", "outbox", "coalescer_outbox", 1000, 1.0, 6)
    assert "secret" not in repr(source)
    assert SOURCE_TYPES["outbox"].open is open_outboxes
    assert SOURCE_TYPES["outbox"].status is outbox_status
    assert issubclass(OutboxSources, object)


@pytest.mark.parametrize(("block", "field", "words"), [
    ("{name: a, type: outbox, url: 'sqlite:///x.db', stream: s}", "sources[0].stream",
     "field 'stream' is not a field of a outbox source"),
    ("{name: a, type: outbox}", "sources[0].url", "missing the required field 'url'"),
    ("{name: a, type: outbox, url: 'mysql://u:hidden@127.0.0.1/db'}", "sources[0].url",
     "must be a SQLAlchemy URL of PostgreSQL"),
    ("{name: a, type: outbox, url: 'sqlite://'}", "sources[0].url", "in-memory SQLite"),
    ("{name: a, type: outbox, url: 'sqlite:///:memory:'}", "sources[0].url", "in-memory"),
    ("{name: a, type: outbox, url: 'postgresql://${1X}@h/db'}", "sources[0].url",
     "${1X} must name an environment variable"),
    ("{name: a, type: outbox, url: 'sqlite:///x.db', table: 'a;drop'}", "sources[0].table",
     "must be a table name, or schema.table"),
    ("{name: a, type: outbox, url: 'sqlite:///x.db', batch: 0}", "sources[0].batch",
     "positive whole number"),
    ("{name: a, type: outbox, url: 'sqlite:///x.db', batch: 20000}", "sources[0].batch",
     "at most 10000"),
    ("{name: a, type: outbox, url: 'sqlite:///x.db', poll: 2m}", "sources[0].poll",
     "at most 1m"),
    ("{name: a, type: outbox, url: 'sqlite:///x.db', poll: 0}", "sources[0].poll",
     "longer than 0"),
    ("{name: a, type: queue, url: 'sqlite:///x.db'}", "sources[0].type",
     "known types: stream, outbox"),
])
def test_bad_outbox_sources_name_file_line_and_field(block: str, field: str,
                                                     words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load("sources:\n  - " + block + "\n")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", 6, field)
    assert words in err.message
    assert "hidden" not in str(err)


def test_a_url_from_the_environment_is_resolved_when_a_node_starts(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(BASE + "sources:\n  - {name: a, type: outbox, url: '${SHOP_DB}'}\n")
    config = Config.from_yaml(rules)
    (source,) = config.sources
    assert source.env_names == ["SHOP_DB"]
    (err,) = check_outbox(source, 0, config, {})
    assert (err.file, err.line, err.field) == (str(rules), 6, "sources[0].url")
    assert "environment variable SHOP_DB, which is not set" in err.message
    (err,) = check_outbox(source, 0, config, {"SHOP_DB": "mysql://u:pw@h/db"})
    assert "must be a SQLAlchemy URL" in err.message and "pw" not in err.message
    assert check_outbox(source, 0, config, {"SHOP_DB": f"sqlite:///{tmp_path}/x.db"}) == []
    with pytest.raises(ConfigError, match="SHOP_DB"):
        Coalescer.from_yaml(rules, worker=True)  # a worker refuses to start
    Coalescer.from_yaml(rules, worker=False)  # a writer never reads sources


def test_coalescer_check_warns_of_an_unset_variable_of_a_url(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(BASE + "sources:\n  - {name: a, type: outbox, "
                     "url: 'postgresql://app:${PW}@127.0.0.1/${DB}'}\n")
    report = check_file(rules, {"DB": "shop"})
    (warning,) = report.warnings
    assert (warning.line, warning.field) == (6, "sources[0].url")
    assert "environment variable PW is not set" in warning.message
    assert "'a'" in warning.message and report.errors == ()
    assert check_file(rules, {"DB": "shop", "PW": "x"}).warnings == ()
    assert [w.field for w in Config.from_yaml(rules).warnings({})] == ["sources[0].url"] * 2


@pytest.mark.parametrize(("url", "module", "extra"), [
    ("postgresql://127.0.0.1/db", "psycopg", "coalescer[postgres]"),
    ("sqlite:///x.db", "aiosqlite", "coalescer[sqlite]"),
])
def test_a_missing_driver_names_the_extra_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, module: str,
        extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    rules = tmp_path / "rules.yaml"
    rules.write_text(BASE + f"sources:\n  - {{name: a, type: outbox, url: '{url}'}}\n")
    with pytest.raises(ConfigError) as info:
        Coalescer.from_yaml(rules, worker=True)
    assert (info.value.line, info.value.field) == (6, "sources[0].url")
    assert f"needs the {module} package" in str(info.value)
    assert f"pip install '{extra}'" in str(info.value)


LEFT_OPEN = """\
import asyncio, sqlite3, sys
from pathlib import Path
from coalescer.config.rules import Config
from coalescer.sources.outbox_db import open_outbox

db = Path(sys.argv[1])
sqlite3.connect(db).execute(
    "CREATE TABLE coalescer_outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, "
    "item TEXT)")
config = Config.from_string(sys.argv[2], source="rules.yaml")
outbox = open_outbox(config.sources[0], f"sqlite:///{db}", db.parent)
asyncio.run(outbox.connect())  # and never closed
print("connected", flush=True)
"""


def test_a_sqlite_outbox_never_closed_does_not_keep_its_process_alive(tmp_path: Path) -> None:
    rules = BASE + "sources:\n  - {name: orders, type: outbox, url: 'sqlite:///x.db'}\n"
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN, str(tmp_path / "x.db"), rules],
                          check=False, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "connected\n"), done.stderr


def test_a_nodes_error_in_the_status_text_shows_control_characters_escaped() -> None:
    status = {"sources": {"orders": {
        "type": "outbox", "table": "coalescer_outbox", "url": "sqlite:///x.db", "rejected": 0,
        "lag_seconds": 0.0, "backlog": 0,
        "errors": {"n1": "duplicate value \x1b[2J\nFAKE LINE"}}}}
    error_line = format_sources(status)[-1]
    assert error_line.endswith("error on n1: duplicate value \\x1b[2J\\x0aFAKE LINE")


# -- on real servers ----------------------------------------------------------------------

SETTINGS = """\
namespace: {ns}
claim_lease: 1s
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutboxDb]:
    url = request.getfixturevalue("postgres").url if request.param == "postgresql" else None
    found = new_outbox(request.param, tmp_path, url)
    yield found
    found.table.drop(found.engine)
    found.engine.dispose()


@pytest_asyncio.fixture
async def nodes(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """nodes(rules_path, redis_url, **options) -> a started Coalescer, closed at teardown:
    before the test's outbox table is dropped (a node left in its claim's transaction
    would hold the drop, with the event loop, until the database's idle timeout)."""
    if "outbox" in request.fixturenames:
        request.getfixturevalue("outbox")  # set up first, so torn down last
    async with AsyncExitStack() as stack:
        async def make(path: Path, url: str, **options: Any) -> Coalescer:
            options.setdefault("grace", 2.0)
            c = Coalescer.from_yaml(path, redis_url=url, **options)
            await stack.enter_async_context(c)
            return c

        yield make


def rules(tmp_path: Path, namespace: str, outbox: OutboxDb, **extra: Any) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(SETTINGS.format(ns=namespace) + BASE + outbox.source(**extra))
    return path


def counted(c: Coalescer, outcome: str, source: str = "orders") -> float:
    value = c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": source, "outcome": outcome})
    return value or 0.0


async def sources_polling(r: Any, namespace: str, nodes: int) -> bool:
    """Whether ``nodes`` nodes' outbox sources have polled (each reports on its first)."""
    return bool(await r.hlen(sources_outbox(namespace)) == nodes)


def keys(*ids: object) -> list[str]:
    return [f"stats:customer:{i}" for i in ids]


async def test_committed_rows_become_pending_keys_and_leave_the_table(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox")
    c = await nodes(rules(tmp_path, namespace, outbox, poll="50ms"), redis_url)
    outbox.write(keys(1, 2, 3))
    outbox.write(keys(2, 4))
    outbox.write(keys(5), rollback=True)  # rolled back: never a row
    outbox.write(["orders:1", "stats:customer:a:b"])  # keys no rule matches
    await wait_until(lambda: counted(c, "rejected") == 2, message="rows rejected")
    assert await pending_keys(redis_client, namespace) == set(keys(1, 2, 3, 4))
    assert outbox.rows() == 0
    assert counted(c, "accepted") == 5
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "no rule matches key 'orders:1'" in logged
    status = await c.query.status()
    entry = status["sources"]["orders"]
    assert (entry["type"], entry["table"], entry["rejected"]) == ("outbox", outbox.table.name, 2)
    assert (entry["backlog"], entry["lag_seconds"], entry["errors"]) == (0, 0.0, {})
    registry = c.metrics.registry
    assert registry.get_sample_value("coalescer_outbox_backlog_rows", {"source": "orders"}) == 0
    assert registry.get_sample_value("coalescer_outbox_lag_seconds", {"source": "orders"}) == 0
    (line,) = format_sources(status)[2:]
    assert line.split()[:4] == ["orders", "0.0s", "0", "2"]
    assert f"outbox {outbox.table.name} at" in line


async def test_hostile_bytes_in_rows_are_touched_exactly_or_logged_escaped(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox")
    c = await nodes(rules(tmp_path, namespace, outbox, poll="50ms"), redis_url)
    clear, clipboard = "stats:customer:\x1b[2J\x1b[H", "orders:\x1b]52;c;eA==\x07\nFAKE LINE"
    outbox.write([clear, clipboard])
    await wait_until(lambda: counted(c, "rejected") == 1 and outbox.rows() == 0)
    assert await pending_keys(redis_client, namespace) == {clear}  # the exact bytes
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "no rule matches key 'orders:\\x1b]52;c;eA==\\x07\\nFAKE LINE'" in logged
    assert "\x1b" not in logged and "\nFAKE" not in logged


async def test_items_of_rows_reach_the_next_refresh_of_their_key(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox")
    path = tmp_path / "rules.yaml"
    path.write_text(SETTINGS.format(ns=namespace) + BASE + """\
  - name: order
    match: "stats:order:{id}"
    items: {max: 100}
    handler: builtins:repr
""" + outbox.source(poll="50ms"))
    c = await nodes(path, redis_url)
    with Session(outbox.engine) as session:
        touch_in_transaction(session, "stats:order:1", item="line-1", table=outbox.table)
        touch_in_transaction(session, "stats:order:1", item="line-2", table=outbox.table)
        touch_in_transaction(session, "stats:order:2", table=outbox.table)  # no item
        touch_in_transaction(session, *keys(1), item="x", table=outbox.table)  # no items:
        session.commit()
    await wait_until(lambda: counted(c, "rejected") == 1 and outbox.rows() == 0)
    claims = {claim.key: claim for claim in await c.drain(timeout=30)}
    assert sorted(claims) == ["stats:order:1", "stats:order:2"]
    assert claims["stats:order:1"].items == ("line-1", "line-2")
    assert claims["stats:order:2"].items == ()
    assert counted(c, "accepted") == 3
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "item 'x' cannot be touched: the rule of key 'stats:customer:1' takes no items" \
        in logged


async def test_two_nodes_share_an_outbox_and_no_row_is_lost(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb) -> None:
    path = rules(tmp_path, namespace, outbox, poll="20ms", batch=7)
    a = await nodes(path, redis_url, node_id="a")
    b = await nodes(path, redis_url, node_id="b")
    await wait_until(lambda: sources_polling(redis_client, namespace, 2), timeout=15,
                     message="both nodes' outbox sources polling")
    for start in range(0, 300, 10):
        outbox.write(keys(*range(start, start + 10)))
    await wait_until(lambda: outbox.rows() == 0, timeout=30, message="the outbox emptied")
    assert await pending_keys(redis_client, namespace) == set(keys(*range(300)))
    total = counted(a, "accepted") + counted(b, "accepted")
    if outbox.kind == "postgresql":
        assert total == 300  # SKIP LOCKED: each row claimed by one node
        assert counted(a, "accepted") > 0 and counted(b, "accepted") > 0
    else:
        assert total >= 300  # both may read a row before one deletes it: touched twice


async def test_rows_wait_while_redis_is_down_and_are_touched_once_it_is_back(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, nodes: Any,
        outbox: OutboxDb, *, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox")
    c = await nodes(rules(tmp_path, namespace, outbox, poll="50ms"), own_server.url)
    outbox.write(keys("before"))
    await wait_until(lambda: outbox.rows() == 0)
    own_server.stop()
    for n in range(20):
        outbox.write(keys(n))
    await wait_until(lambda: c.metrics.registry.get_sample_value(
        "coalescer_outbox_errors_total", {"source": "orders"}), message="a failed claim")
    assert outbox.rows() == 20  # waiting in the database
    own_server.start()  # empty: no persistence
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        await wait_until(lambda: outbox.rows() == 0, timeout=20, message="caught up")
        assert await pending_keys(client, namespace) >= set(keys(*range(20)))
    finally:
        await client.aclose()
    failed = [r.getMessage() for r in caplog.records if "failed, will retry" in r.getMessage()
              and r.name == "coalescer.sources.outbox"]
    assert len(failed) == 1  # logged once for the run of errors
    assert f"source orders: outbox {outbox.table.name} at" in failed[0]


async def test_notify_wakes_the_node_long_before_its_poll(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        postgres: PostgresServer) -> None:
    outbox = new_outbox("postgresql", tmp_path, postgres.url)
    try:
        c = await nodes(rules(tmp_path, namespace, outbox, poll="1m"), redis_url)
        outbox.write(keys("first"))  # the start's claim may or may not see it
        await wait_until(lambda: outbox.rows() == 0, timeout=70)
        for n in range(3):  # every one found at once: a poll would take a minute
            outbox.write(keys(n))
            await wait_until(lambda n=n: counted(c, "accepted") >= 2 + n, timeout=20,
                             message=f"row {n} claimed")
    finally:
        outbox.table.drop(outbox.engine)
        outbox.engine.dispose()


async def test_a_database_that_goes_down_is_retried_and_reported(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        nodes: Any) -> None:
    server = PostgresServer().start()
    try:
        server.wait_ready()
        outbox = new_outbox("postgresql", tmp_path, server.url)
        c = await nodes(rules(tmp_path, namespace, outbox, poll="50ms"), redis_url)
        outbox.write(keys(1))
        await wait_until(lambda: outbox.rows() == 0)
        outbox.engine.dispose()
        server.stop()

        async def error_shown() -> Any:
            return (await c.query.status())["sources"]["orders"]["errors"]
        errors = await wait_until(error_shown, timeout=20, message="the error in status")
        assert list(errors) == [c.node_id]
        server.start()
        server.wait_ready()
        outbox.write(keys(2))
        await wait_until(lambda: outbox.rows() == 0, timeout=20, message="claimed again")
        assert await pending_keys(redis_client, namespace) == set(keys(1, 2))
        assert await wait_until(lambda: _no_errors(c), timeout=20)
    finally:
        server.close()


async def _no_errors(c: Coalescer) -> bool:
    return (await c.query.status())["sources"]["orders"]["errors"] == {}


async def test_a_missing_sqlite_file_is_an_error_until_it_exists(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        nodes: Any) -> None:
    path = tmp_path / "rules.yaml"  # a relative path starts from the rules file's folder
    path.write_text(SETTINGS.format(ns=namespace) + BASE + "sources:\n  - {name: orders, "
                    "type: outbox, url: 'sqlite:///later.db', poll: 50ms}\n")
    c = await nodes(path, redis_url)

    async def error() -> Any:
        return (await c.query.status())["sources"]["orders"]["errors"].get(c.node_id)
    assert "no SQLite database at" in await wait_until(error, timeout=20)
    assert not (tmp_path / "later.db").exists()  # never created by the node
    engine = make_engine(f"sqlite:///{tmp_path / 'later.db'}")
    metadata = MetaData()
    outbox_table(metadata)
    metadata.create_all(engine)
    with Session(engine) as session:
        touch_in_transaction(session, *keys(1))
        session.commit()
    engine.dispose()
    await wait_until(lambda: _pending_is(redis_client, namespace, set(keys(1))), timeout=20)


async def _pending_is(redis_client: Any, namespace: str, expected: set[str]) -> bool:
    return await pending_keys(redis_client, namespace) == expected


async def test_a_stopped_node_forgets_its_report(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb) -> None:
    c = await nodes(rules(tmp_path, namespace, outbox, poll="50ms"), redis_url)
    reader = await nodes(rules(tmp_path, namespace, outbox), redis_url, worker=False)
    await wait_until(lambda: _nodes_reporting(reader, 1))
    await c.close()
    assert (await reader.query.status())["sources"]["orders"]["nodes"] == 0


async def _nodes_reporting(c: Coalescer, n: int) -> bool:
    return bool((await c.query.status())["sources"]["orders"]["nodes"] == n)


async def test_the_backlog_counts_waiting_rows_and_the_oldest_ones_age(
        tmp_path: Path, outbox: OutboxDb) -> None:
    config = Config.from_string(BASE + outbox.source(), source=str(tmp_path / "rules.yaml"))
    (source,) = config.sources
    db = open_outbox(source, source.url, tmp_path)
    await db.connect()
    try:
        assert await db.backlog() == Backlog(0, False, 0.0)
        outbox.write(keys(1, 2, 3))
        outbox.write(keys(4))
        found = await db.backlog()
        assert (found.rows, found.capped) == (4, False)
        assert 0 <= found.lag < 60
        assert await db.claim(3) == [(k, None) for k in keys(1, 2, 3)]
        await db.undo()  # the rows stay
        assert (await db.backlog()).rows == 4
        assert len(await db.claim(10)) == 4
        await db.done()
        assert (await db.backlog()).rows == 0
    finally:
        await db.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_a_table_made_by_hand_is_read_with_a_warning_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        request: pytest.FixtureRequest, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """No NOTIFY trigger (PostgreSQL: found by polling) or no AUTOINCREMENT (SQLite)."""
    url = request.getfixturevalue("postgres").url if kind == "postgresql" else \
        f"sqlite:///{tmp_path / 'hand.db'}"
    name = f"hand_{namespace}"
    engine = make_engine(url)
    ident = "bigserial" if kind == "postgresql" else "INTEGER"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id {ident} PRIMARY KEY, key TEXT NOT NULL, "
                          "item TEXT, created_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP)"))
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox_db")
    path = tmp_path / "rules.yaml"
    path.write_text(SETTINGS.format(ns=namespace) + BASE + "sources:\n  - {name: orders, "
                    f"type: outbox, url: '{url}', table: {name}, poll: 50ms}}\n")
    try:
        await nodes(path, redis_url)
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {name} (key) VALUES ('stats:customer:1'), "
                              "('stats:customer:2')"))
        await wait_until(lambda: _pending_is(redis_client, namespace, set(keys(1, 2))),
                         timeout=20)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {name}"))
        engine.dispose()
    warned = [r.getMessage() for r in caplog.records if r.name == "coalescer.sources.outbox_db"]
    expected = "has no NOTIFY trigger" if kind == "postgresql" else "is not AUTOINCREMENT"
    assert len(warned) == 1 and expected in warned[0]


async def test_a_stop_cut_short_by_its_deadline_still_closes_the_connections(
        tmp_path: Path) -> None:
    sqlite_db = new_outbox("sqlite", tmp_path, None)
    config = Config.from_string(BASE + sqlite_db.source(), source=str(tmp_path / "rules.yaml"))
    db = open_outbox(config.sources[0], config.sources[0].url, tmp_path)
    await db.connect()
    thread = db._conn._thread  # the connection's own thread

    async def slow_to_stop() -> None:  # a loop that takes long to end once cancelled
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(5)
            raise

    sources = OutboxSources([], [db])
    sources._tasks = [asyncio.create_task(slow_to_stop())]
    await asyncio.sleep(0)  # it runs
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sources.stop(), 0.2)  # a shutdown's deadline
    thread.join(5)
    assert not thread.is_alive()
    sqlite_db.engine.dispose()
