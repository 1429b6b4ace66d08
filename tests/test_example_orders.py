"""The orders example end to end: orders published to a real Kafka-protocol broker
(Tansu) with their own deadline, a `coalescer run` node on a real valkey-server, the
shop's SQLite database. The rules are the example's, as they are."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.kafka_broker import TansuBroker
from coalescer import Coalescer
from coalescer.query.history import HistoryQuery
from examples.orders import shop
from tests.helpers.e2e import REPO, NodeProcs
from tests.helpers.servers import wait_until


@pytest.fixture
def procs(tmp_path: Path) -> Any:
    started = NodeProcs(tmp_path)
    yield started
    started.stop_all()


async def test_an_unpaid_order_is_cancelled_at_its_own_time_and_a_paid_one_is_not(
        tmp_path: Path, namespace: str, kafka: TansuBroker, redis_url: str, *,
        procs: NodeProcs, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(shop.RULES.read_text()  # the namespace names the source's group too
                     .replace("namespace: orders", f"namespace: {namespace}"))
    env = {"KAFKA_BOOTSTRAP": kafka.bootstrap, "ORDERS_DB": str(tmp_path / "orders.db")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # the node runs in tmp_path: the handler's module is found through PYTHONPATH
    node = procs.start(rules, redis_url, "node-a", PYTHONPATH=str(REPO), **env)
    assert node.poll() is None
    deadline = await shop.place("late", 3600)
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        async def scheduled(key: str) -> bool:
            return (await c.query.explain(key)).get("state") == "pending"

        await wait_until(lambda: scheduled("order:unpaid:late"), timeout=30,
                         message="order late's check scheduled (the node reads the topic)")
        # due at the deadline the message carries, not counted from when it was read
        late = await c.query.explain("order:unpaid:late")
        assert late["due_ms"] == round(
            datetime.datetime.fromisoformat(deadline).timestamp() * 1000)
        await shop.place("b", 5 / 60)  # 5 seconds to pay
        await shop.place("a", 5 / 60)
        await wait_until(lambda: scheduled("order:unpaid:b"), timeout=30,
                         message="order b's check scheduled")
        assert await shop.pay("b", rules, redis_url=redis_url) == "paid; check dropped"
        await wait_until(lambda: shop.show().get("a") == "cancelled", timeout=30,
                         message="order a cancelled")
        async def outcomes() -> list[tuple[str, str]]:
            history = await c.query.history(HistoryQuery(limit=10))
            return sorted((entry.key, entry.outcome) for entry in history)

        async def a_recorded() -> bool:  # the history entry follows the handler's end
            return ("order:unpaid:a", "success") in await outcomes()

        await wait_until(a_recorded, timeout=10)
        # b was due no later than a: its time has come, and its check did not run
        assert await outcomes() == [("order:unpaid:a", "success"),
                                    ("order:unpaid:b", "cancelled")]
    assert shop.show() == {"a": "cancelled", "b": "paid", "late": "unpaid"}
    cli = subprocess.run([sys.executable, "-m", "examples.orders.shop", "show"], cwd=REPO,
                         env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True, timeout=60)
    assert cli.stdout.split("\n")[:3] == ["a cancelled", "b paid", "late unpaid"]
