"""A source's ``at:``/``delay:``: each event's touch gets a time of its own, filled from
the event's fields; an event whose time cannot be made is rejected (counted,
acknowledged, logged with its id), never blocking the source. The rules-file part runs
without a server; the rest on a real valkey-server, writing entries with XADD."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from coalescer.config.rules import Config
from coalescer.errors import ConfigError
from coalescer.sources.outbox import check_outbox
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import server_ms
from tests.helpers.outbox import OutboxDb
from tests.helpers.servers import wait_until
from tests.sources.test_outbox import outbox
from tests.sources.test_streams import entries_counted, group_info, nodes, setup

__all__ = ["nodes", "outbox"]  # the fixtures, used by name

BASE = """\
rules:
  - name: order
    match: "order:unpaid:{id}"
    handler: builtins:repr
sources:
"""


def load(block: str) -> Config:
    return Config.from_string(BASE + block, source="rules.yaml")


def test_every_source_type_takes_at_or_delay() -> None:
    config = load("""\
  - name: kafka-like
    stream: orders
    key: "order:unpaid:{orderId}"
    delay: "{delayTime}m"
  - name: rows
    type: outbox
    url: sqlite:///app.db
    at: "{run_at}"
  - name: fixed
    stream: other
    key: "order:unpaid:{orderId}"
    delay: 30
""")
    stream, outbox, fixed = config.sources
    assert stream.delay is not None and stream.delay.fill({"delayTime": "30"}) == "30m"
    assert (stream.at, stream.time_fields) == (None, ("delayTime",))
    assert outbox.at is not None and outbox.time_fields == ("run_at",)
    assert fixed.delay is not None and fixed.delay.source == "30"


@pytest.mark.parametrize(("block", "field", "words"), [
    ("    at: '{a}'\n    delay: '{d}'\n", "sources[0].delay", "give at: or delay:, not both"),
    ("    delay: '-5s'\n", "sources[0].delay", "a negative delay"),
    ("    delay: 'soon'\n", "sources[0].delay", "not a delay"),
    ("    at: '2030-01-01T12:00:00'\n", "sources[0].at", "a naive datetime"),
    ("    at: '{a'\n", "sources[0].at", "unbalanced '{' in at template"),
])
def test_a_bad_time_template_names_file_line_and_field(block: str, field: str,
                                                        words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load("  - name: s\n    stream: s\n    key: 'order:unpaid:{o}'\n" + block)
    err = info.value
    assert (err.file, err.field) == ("rules.yaml", field)
    assert words in err.message


RULES = """\
namespace: {ns}
claim_lease: 1s
defaults:
  window: 100ms
  absorb: 10ms
rules:
  - name: order
    match: "order:unpaid:{{id}}"
    handler: {{mod}}:refresh
sources:
  - name: orders
    stream: "{ns}-app:orders"
    key: "order:unpaid:{{orderId}}"
    delay: "{{delayTime}}m"
  - name: payments
    stream: "{ns}-app:payments"
    key: "order:unpaid:{{orderId}}"
    at: "{{payBy}}"
"""


async def due(redis: Any, namespace: str, key: str) -> states.Pending | None:
    value = await redis.hget(KeySpace(namespace, 1).shard(0).meta, key)
    return None if value is None else states.pending(value)


async def test_entries_schedule_their_keys_and_bad_times_are_rejected(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    path, _ = setup(tmp_path, namespace, RULES.format(ns=namespace))
    orders, payments = f"{namespace}-app:orders", f"{namespace}-app:payments"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, orders))
    await wait_until(lambda: group_info(redis_client, payments))
    caplog.set_level(logging.WARNING, logger="coalescer.sources.streams")
    pay_by = datetime.now(UTC).replace(microsecond=0) + timedelta(days=2)
    before = await server_ms(redis_client)
    bad = [
        await redis_client.xadd(orders, {"orderId": "b1"}),  # no delayTime
        await redis_client.xadd(orders, {"orderId": "b2", "delayTime": "soon"}),
        await redis_client.xadd(orders, {"orderId": "b3", "delayTime": "-5"}),
        await redis_client.xadd(payments, {"orderId": "b4", "payBy": "2030-01-01T12:00:00"}),
    ]
    await redis_client.xadd(orders, {"orderId": "a", "delayTime": "30"})
    await redis_client.xadd(payments, {"orderId": "p", "payBy": pay_by.isoformat()})
    await redis_client.xadd(payments, {"orderId": "e", "payBy": str(int(time.time()) + 600)})
    await wait_until(lambda: entries_counted(c, "rejected", "orders") == 3)
    await wait_until(lambda: entries_counted(c, "rejected", "payments") == 1)
    await wait_until(lambda: entries_counted(c, "accepted", "payments") == 2)
    assert entries_counted(c, "accepted", "orders") == 1
    after = await server_ms(redis_client)
    a = await due(redis_client, namespace, "order:unpaid:a")
    assert a is not None and a.scheduled and before + 1_800_000 <= a.due_ms <= after + 1_800_000
    p = await due(redis_client, namespace, "order:unpaid:p")
    assert p is not None and p.scheduled and p.due_ms == int(pay_by.timestamp()) * 1000
    e = await due(redis_client, namespace, "order:unpaid:e")
    assert e is not None and e.scheduled
    for key in ("b1", "b2", "b3", "b4"):
        assert await due(redis_client, namespace, f"order:unpaid:{key}") is None
    for stream in (orders, payments):
        group = await group_info(redis_client, stream)
        assert group is not None and group["pending"] == 0  # every entry acknowledged
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for entry_id, why in zip(bad, ["no field 'delayTime' (for its delay)", "not a delay",
                                   "a negative delay", "a naive datetime"], strict=True):
        assert f"entry {entry_id} of stream" in logged
        assert why in logged


# -- outbox rows: the columns the template names ---------------------------------------

OUTBOX_RULES = """\
namespace: {ns}
claim_lease: 1s
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
rules:
  - name: order
    match: "order:unpaid:{{id}}"
    handler: builtins:repr
"""


async def test_outbox_rows_schedule_their_keys_from_a_column_of_their_own(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        outbox: OutboxDb, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="coalescer.sources.outbox")
    table = outbox.table.name
    with outbox.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN delay_s VARCHAR(20)"))
    path = tmp_path / "rules.yaml"
    path.write_text(OUTBOX_RULES.format(ns=namespace)
                    + outbox.source(poll="50ms", delay='"{delay_s}s"'))
    before = await server_ms(redis_client)
    with outbox.engine.begin() as conn:
        for key, delay in (("a", "90"), ("b", "soon"), ("c", None), ("d", "-1")):
            conn.execute(text(f"INSERT INTO {table} (key, delay_s) VALUES (:k, :d)"),
                         {"k": f"order:unpaid:{key}", "d": delay})
    c = await nodes(path, redis_url)
    await wait_until(lambda: entries_counted(c, "rejected") == 3 and outbox.rows() == 0,
                     message="the rows read")
    after = await server_ms(redis_client)
    assert entries_counted(c, "accepted") == 1
    a = await due(redis_client, namespace, "order:unpaid:a")
    assert a is not None and a.scheduled and before + 90_000 <= a.due_ms <= after + 90_000
    for key in ("b", "c", "d"):
        assert await due(redis_client, namespace, f"order:unpaid:{key}") is None
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for why in ("'order:unpaid:b': time 'soons'", "no field 'delay_s' (for its delay)",
                "a negative delay"):
        assert why in logged


def test_an_outbox_time_template_must_name_columns(tmp_path: Path) -> None:
    config = Config.from_string(BASE + """\
  - name: rows
    type: outbox
    url: sqlite:///app.db
    delay: "{delay in s}s"
""", source="rules.yaml")
    [problem] = check_outbox(config.sources[0], 0, config, {})
    assert (problem.field, problem.line) == ("sources[0].delay", 6)
    assert "must name a column of the outbox table" in problem.message
