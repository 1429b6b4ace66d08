"""`status` and `explain` say when no worker runs for a rule: nothing will refresh its
pending keys, and no node reads the sources, until one starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis.asyncio

from coalescer.query.explain import format_explain
from coalescer.query.status import format_status
from coalescer.store.keys import KeySpace, node_leases
from coalescer.store.scripts import Scripts
from coalescer.worker.registry import encode
from tests.helpers.e2e import server_ms
from tests.helpers.inspection import node, write
from tests.helpers.outbox import new_outbox
from tests.helpers.servers import wait_until

HINT = ("no worker is running for this rule: pending keys will not be refreshed until one "
        "starts (`coalescer run`)")
NO_NODE = ("no worker is running: no node has renewed its lease; pending keys will not be "
           "refreshed, and no source is read, until one starts (`coalescer run`)")
SOURCES = ("sources events, orders are not being read (no worker is running): touches "
           "waiting there do not show here until one starts")

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 60s
    max_wait: 2m
    handler: {{mod}}:refresh
{extra}sources:
  - {{name: events, stream: "{ns}-events", key: "stats:{{id}}"}}
"""

ONLY_HERE = """\
  - name: only-here
    match: "only:{id}"
    window: 60s
    max_wait: 2m
    handler: {mod}:refresh
"""


def rules_text(ns: str, *, only_here: bool) -> str:
    return RULES.format(ns=ns, extra=ONLY_HERE if only_here else "")


def explained(info: dict[str, Any]) -> list[str]:
    """The state lines of ``coalescer explain``, without their indentation."""
    lines = format_explain(info).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("state "))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith("    "))
    return [line.strip().removeprefix("state").strip() for line in lines[start:end]]


async def test_with_no_node_status_and_explain_say_nothing_will_refresh_or_read(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    outbox = new_outbox("sqlite", tmp_path, None)
    orders = outbox.source("orders").removeprefix("sources:\n")
    rules, _ = write(tmp_path, namespace, rules_text(namespace, only_here=False) + orders)
    outbox.write(["stats:outboxed"])  # committed with the app's data; only a node reads it
    async with node(rules, redis_url, worker=False) as c:
        c.touch_many(["stats:late", "stats:soon"])
        await c.flush()
        assert (await c.query.run_now(["stats:late"])).run == ["stats:late"]

        status = await c.query.status()
        assert status["nodes"] == []
        assert status["rules"]["stats"]["no_worker"] is True
        assert status["sources"]["events"]["unread"] is True
        assert status["sources"]["orders"]["unread"] is True
        lines = format_status(status, 0).splitlines()
        row = next(line for line in lines if line.startswith("stats "))
        assert row.endswith("  no worker is running for this rule")
        assert NO_NODE in lines
        source = lines.index(next(line for line in lines if line.startswith("events ")))
        assert lines[source + 1].strip() == "its events are not being read: no worker is running"

        late = await c.query.explain("stats:late")
        assert late["no_worker"] is True and late["unread_sources"] == ["events", "orders"]
        assert late["due_ms"] <= late["now_ms"]
        state = explained(late)
        assert state[0].startswith("pending: due ") and " ago " in state[0]
        assert state[1:] == [f"overdue: {HINT}", SOURCES]

        soon = explained(await c.query.explain("stats:soon"))
        assert soon[0].startswith("pending: due in ")
        assert soon[1:] == [HINT, SOURCES]

        outboxed = explained(await c.query.explain("stats:outboxed"))
        assert outboxed == ["idle: nothing pending, running or dead (its next touch starts a "
                            "burst)", HINT, SOURCES]
    assert outbox.rows() == 1


async def test_a_live_node_silences_the_hint_for_its_rules_only(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    write(tmp_path, namespace, rules_text(namespace, only_here=False))  # the node's file
    (tmp_path / "rules.yaml").rename(tmp_path / "node.yaml")
    reader, _ = write(tmp_path, namespace, rules_text(namespace, only_here=True))
    async with node(tmp_path / "node.yaml", redis_url, node_id="serving"), \
            node(reader, redis_url, worker=False, node_id="reader") as c:
        async def registered() -> dict[str, Any] | None:
            status = await c.query.status()
            return status if [n["node"] for n in status["nodes"]] == ["serving"] else None
        status = await wait_until(registered, message="the node in the registry")
        c.touch_many(["stats:1", "only:1"])
        await c.flush()

        assert status["rules"]["stats"]["no_worker"] is False
        assert status["rules"]["only-here"]["no_worker"] is True
        assert status["sources"]["events"]["unread"] is False
        lines = format_status(status, 0).splitlines()
        assert not next(line for line in lines if line.startswith("stats ")).endswith("rule")
        assert next(line for line in lines if line.startswith("only-here ")).endswith(
            "  no worker is running for this rule")
        assert ("no live node's rules file has rule only-here: pending keys will not be "
                "refreshed until a worker with it starts (`coalescer run`)") in lines
        assert not any("not being read" in line or "no node has renewed" in line
                       for line in lines)

        served = await c.query.explain("stats:1")
        assert served["no_worker"] is False and served["unread_sources"] == []
        assert len(explained(served)) == 1 and "no worker" not in format_explain(served)
        unserved = await c.query.explain("only:1")
        assert unserved["no_worker"] is True and unserved["unread_sources"] == []
        assert explained(unserved)[1:] == [HINT]


async def test_a_node_whose_lease_lapsed_is_no_worker(
        tmp_path: Path, redis_url: str, namespace: str,
        redis_client: redis.asyncio.Redis) -> None:
    """A node that stopped without leaving (killed) keeps its lease entry and registry
    entry: it counts as a worker only until its lease ends unrenewed."""
    rules, _ = write(tmp_path, namespace, rules_text(namespace, only_here=False))
    async with node(rules, redis_url, worker=False) as c:
        scripts = Scripts(redis_client)
        lease = await scripts.node_lease(node_leases(namespace), node_id="gone",
                                         lease_ms=2000)
        await scripts.acquire(KeySpace(namespace, 1).shard(0), node_id="gone",
                              lease_ms=2000, mine="", rules=encode(c.config.rules))
        assert (await c.query.explain("stats:1"))["no_worker"] is False
        assert await server_ms(redis_client) < lease.ends["gone"]  # read while it lived

        async def lapsed() -> bool:
            return bool((await c.query.explain("stats:1"))["no_worker"])
        await wait_until(lapsed, message="the unrenewed lease to end")
        status = await c.query.status()
        assert status["nodes"] == [] and status["rules"]["stats"]["no_worker"] is True
