"""Touches written as outbox rows in a Django transaction: the app's migration, a real
SQLite database, the rows read back by a real node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from django.db import connection, transaction

from coalescer import Coalescer, InvalidKeyError, UnknownKeyError
from coalescer.config.rules import Config
from coalescer.integrations.django import outbox_touches, touch_in_transaction
from tests.helpers.django_db import configure
from tests.helpers.outbox import pending_keys
from tests.helpers.servers import wait_until

RULES = Config.from_string("rules:\n  - {name: customer, match: 'stats:customer:{id}', "
                           "handler: builtins:id}\n")


@pytest.fixture(scope="module", autouse=True)
def django_db(tmp_path_factory: pytest.TempPathFactory) -> None:
    configure(tmp_path_factory.mktemp("django"))


@pytest.fixture(autouse=True)
def empty_outbox() -> None:
    outbox_model().objects.all().delete()


def outbox_model() -> Any:
    from coalescer.integrations.django.models import OutboxTouch  # once Django is set up

    return OutboxTouch


def rows() -> list[tuple[str, str | None]]:
    return list(outbox_model().objects.order_by("id").values_list("key", "item"))


def test_the_migration_makes_a_table_that_never_reuses_an_id() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT sql FROM sqlite_master WHERE name = 'coalescer_outbox'")
        (sql,) = cursor.fetchone()
    assert "AUTOINCREMENT" in sql


def test_rows_commit_and_roll_back_with_the_transaction() -> None:
    with transaction.atomic():
        touch_in_transaction("stats:customer:1", "stats:customer:2", "stats:customer:1")
        with pytest.raises(ValueError), transaction.atomic():
            touch_in_transaction("stats:customer:3")
            raise ValueError("undo 3")
        touch_in_transaction("stats:customer:4", item="order-9")
    with pytest.raises(RuntimeError), transaction.atomic():
        touch_in_transaction("stats:customer:5")
        raise RuntimeError("the request failed")
    assert rows() == [("stats:customer:1", None), ("stats:customer:2", None),
                      ("stats:customer:4", "order-9")]


def test_one_call_is_one_insert() -> None:
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        touch_in_transaction(*[f"stats:customer:{n}" for n in range(300)])
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert len(rows()) == 300


def test_touches_collected_in_a_block_are_one_insert_for_the_transaction() -> None:
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries, transaction.atomic(), \
            outbox_touches(rules=RULES) as touch:
        for n in range(50):
            touch(f"stats:customer:{n}")
        touch("stats:customer:7")  # twice in the block: one row
        with pytest.raises(UnknownKeyError):
            touch("orders:1")  # refused at once: adds nothing
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert sorted(rows()) == sorted((f"stats:customer:{n}", None) for n in range(50))


def test_a_block_that_raises_writes_nothing() -> None:
    with pytest.raises(RuntimeError), transaction.atomic(), outbox_touches() as touch:
        touch("stats:customer:1")
        raise RuntimeError("the request failed")
    assert rows() == []


def test_keys_are_checked_at_the_call() -> None:
    with pytest.raises(InvalidKeyError):
        touch_in_transaction("stats:customer:1", "bad\0key")
    with pytest.raises(UnknownKeyError, match="orders:1"):
        touch_in_transaction("stats:customer:1", "orders:1", rules=RULES)
    assert rows() == []  # a refused call writes nothing
    touch_in_transaction("orders:1")  # no rules at hand: the node rejects it
    assert rows() == [("orders:1", None)]


@pytest_asyncio.fixture
async def node(tmp_path: Path, namespace: str, redis_url: str) -> AsyncIterator[Coalescer]:
    db = connection.settings_dict["NAME"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"namespace: {namespace}\ndefaults: {{window: 1h, max_wait: 1h}}\n"
                     "rules:\n  - {name: customer, match: 'stats:customer:{id}', "
                     f"handler: builtins:id}}\nsources:\n  - {{name: orders, type: outbox, "
                     f"url: 'sqlite:///{db}', poll: 50ms}}\n")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, grace=2.0) as c:
        yield c


async def test_a_node_reads_the_django_outbox(node: Coalescer, redis_client: Any,
                                              namespace: str) -> None:
    def write() -> None:
        with transaction.atomic():
            touch_in_transaction("stats:customer:7", "stats:customer:8")

    await in_thread(write)
    await wait_until(_emptied, timeout=20, message="the outbox emptied")
    assert await _pending(redis_client, namespace)


T = TypeVar("T")


async def in_thread(call: Callable[[], T]) -> T:
    """``call()`` in a thread of the loop's executor (Django refuses to query from a
    running event loop), its database connection closed after it: nothing outlives the
    test (asgiref's sync_to_async keeps a process-wide thread alive)."""
    def run() -> T:
        try:
            return call()
        finally:
            connection.close()

    return await asyncio.to_thread(run)


async def _emptied() -> bool:
    return await in_thread(rows) == []


async def _pending(redis_client: Any, namespace: str) -> bool:
    return await pending_keys(redis_client, namespace) == {"stats:customer:7",
                                                          "stats:customer:8"}
