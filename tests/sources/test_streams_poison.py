"""Poison entries of a stream source (real nodes on a real valkey-server): an entry that
cannot become a touch, whatever goes wrong reading it, is rejected, counted, logged at
most once a minute per kind, acknowledged, and the next one is read."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from coalescer.sources import streams
from coalescer.sources.streams import SourceLoop
from tests.helpers.servers import wait_until
from tests.sources.test_streams import (  # noqa: F401 (nodes: a fixture)
    entries_counted,
    group_info,
    nodes,
    refreshed,
    rules_text,
    setup,
    source_status,
)


async def test_an_entry_whose_reading_raises_is_rejected_logged_once_and_acknowledged(
        *, tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = SourceLoop.key_of

    def key_of(self: SourceLoop, fields: dict[bytes, bytes] | None) -> Any:
        if fields and fields.get(b"customer_id") == b"boom":  # a fault no check foresaw
            raise RuntimeError("something no one foresaw")
        return real(self, fields)

    monkeypatch.setattr(SourceLoop, "key_of", key_of)
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream))
    caplog.set_level(logging.WARNING, logger=streams.__name__)
    first = await redis_client.xadd(stream, {"customer_id": "boom"})
    for n in range(4):
        await redis_client.xadd(stream, {"customer_id": "boom"})
        await redis_client.xadd(stream, {"customer_id": str(n)})
    await wait_until(lambda: all(rec.of(f"stats:customer:{n}") for n in range(4)),
                     timeout=15, message="every good entry, between the poison ones")
    await wait_until(lambda: entries_counted(c, "rejected") == 5)
    assert entries_counted(c, "accepted") == 4
    status = await source_status(c)
    assert (status["pending"], status["lag"], status["rejected"]) == (0, 0, 5)
    raised = [r.getMessage() for r in caplog.records if "raised RuntimeError" in r.getMessage()]
    assert raised == [f"source orders: entry {first} of stream {stream!r} raised RuntimeError "
                      "while being read: something no one foresaw"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "rejected (acknowledged, not touched): it could not be read (RuntimeError" in logged


@pytest.mark.parametrize(("spaces", "says"), [
    (1000, "longer than 64 characters"),  # the duration's bound
    (1 << 20, f"would make {(1 << 20) + 2} characters, over the limit"),  # the template's
])
async def test_an_entry_with_a_hostile_delay_is_rejected_and_the_next_read(
        *, tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any,  # noqa: F811
        caplog: pytest.LogCaptureFixture, spaces: int, says: str) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace,
                                                      extra="    delay: '{wait}'\n"))
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream))
    caplog.set_level(logging.WARNING, logger=streams.__name__)
    bad = await redis_client.xadd(stream, {"customer_id": "1",
                                           "wait": "1" + " " * spaces + "x"})
    await redis_client.xadd(stream, {"customer_id": "2", "wait": "10ms"})
    await wait_until(lambda: refreshed(rec, "stats:customer:2"), timeout=15)
    await wait_until(lambda: entries_counted(c, "rejected") == 1)
    assert rec.of("stats:customer:1") == []
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"entry {bad} of stream {stream!r} rejected" in logged
    assert says in logged
    assert max(len(r.getMessage()) for r in caplog.records) < 1000


async def test_a_flood_of_bad_entries_logs_at_most_twenty_lines_a_minute(
        *, tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        nodes: Any, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream))
    caplog.set_level(logging.WARNING, logger=streams.__name__)
    for n in range(3):  # three batches of bad entries, each followed by a good one
        for _ in range(15):
            await redis_client.xadd(stream, {"order": "no customer"})
        await redis_client.xadd(stream, {"customer_id": str(n)})
        await wait_until(lambda n=n: refreshed(rec, f"stats:customer:{n}"), timeout=15)
    await wait_until(lambda: entries_counted(c, "rejected") == 45)
    rejected = [r for r in caplog.records if "rejected (acknowledged" in r.getMessage()]
    assert len(rejected) == streams.REJECTS_LOGGED == 20
    assert (await source_status(c))["rejected"] == 45
