"""``edge: leading`` with ``fair`` (and a touch's priority) and with the outbox, on a node
on a real server: each tenant's quiet key leads at once, a touch during a run makes
exactly one more, a tenant's backlog does not hold another's leading refresh behind it,
``max_running`` still holds (a touch of a key waiting at the cap joins its leading run);
rows of an outbox lead and trail as touches do."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from coalescer import Claim
from coalescer.integrations.sqlalchemy import touch_in_transaction
from tests.conftest import Start
from tests.edges.test_leading_edge import RULES, quiet_down
from tests.helpers.e2e import Recorder, recorder_rules, server_ms
from tests.helpers.outbox import OutboxDb, new_outbox
from tests.helpers.servers import wait_until

WINDOW_MS = 300

FAIR_RULES = """\
namespace: {ns}
claim_lease: 2s
defaults:
  window: 300ms
  max_wait: 2s
  absorb: 5ms
  timeout: 5s
  retry: {{attempts: 3, backoff: 20ms, max_backoff: 50ms}}
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    edge: leading
    concurrency: {concurrency}
    handler: {{mod}}:refresh
{fair}"""


def fair_setup(tmp_path: Path, namespace: str, fair: str | None = '{by: "{org}"}',
               concurrency: int = 4) -> tuple[Path, Recorder]:
    """The rules file of a leading rule over tenants; ``fair`` its ``fair:`` (or none)."""
    line = f"    fair: {fair}\n" if fair else ""
    text = FAIR_RULES.format(ns=namespace, concurrency=concurrency, fair=line)
    return recorder_rules(tmp_path, f"leadfair_{namespace}", text)


def org(claim: Claim) -> str:
    return claim.key.split(":")[1]


def leads(claim: Claim) -> bool:
    """Whether the refresh was due at its first touch: a leading run, not a window later."""
    return claim.due_ms == claim.first_touch_ms


async def test_each_tenants_quiet_key_leads_and_a_touch_during_its_run_makes_one_more(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = fair_setup(tmp_path, namespace)
    rec.clock = lambda: server_ms(redis_client)
    gate = asyncio.Event()

    async def hold_a(claim: Claim) -> None:
        if claim.key == "t:a:1" and len(rec.of("t:a:1")) == 1:
            await gate.wait()

    rec.hook = hold_a
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("t:a:1")
    c.touch("t:b:1")
    c.touch("t:c:1", priority="1h")  # a priority of its own: still one leading run
    await c.flush()
    await wait_until(lambda: len(rec.calls) == 3, message="each tenant's leading refresh")
    assert all(leads(claim) for claim in rec.calls), rec.calls
    c.touch("t:a:1")  # after its leading run started
    c.touch("t:a:1", priority="1h")  # a priority does not make it due before its window
    await c.flush()
    last_touch = await server_ms(redis_client)
    gate.set()
    await quiet_down(redis_client, namespace)

    assert [len(rec.of(f"t:{o}:1")) for o in "abc"] == [2, 1, 1]
    first, second = rec.of("t:a:1")
    assert not leads(second) and second.token > first.token
    assert second.due_ms >= second.last_touch_ms + WINDOW_MS
    assert second.last_touch_ms <= last_touch
    assert rec.started("t:a:1")[1] >= second.due_ms


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "due-order"])
async def test_a_quiet_tenants_leading_run_is_not_held_behind_another_tenants_backlog(
        tmp_path: Path, namespace: str, redis_url: str, start: Start, fair: bool) -> None:
    path, rec = fair_setup(tmp_path, namespace, fair='{by: "{org}"}' if fair else None)
    quiet_touched = asyncio.Event()

    async def import_waits(claim: Claim) -> None:
        if org(claim) == "import":
            await quiet_touched.wait()

    rec.hook = import_waits
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch_many(f"t:import:{i}" for i in range(300))  # each one quiet: each one leads
    await c.flush()
    await wait_until(lambda: rec.calls, message="the import's first leading runs")
    c.touch("t:quiet:1")
    await c.flush()
    quiet_touched.set()
    await wait_until(lambda: len(rec.succeeded) == 301, timeout=30,
                     message="every key refreshed")

    keys = [claim.key for claim in rec.calls]
    assert sorted(keys) == sorted([f"t:import:{i}" for i in range(300)] + ["t:quiet:1"])
    assert all(leads(claim) for claim in rec.calls)
    if fair:
        assert keys.index("t:quiet:1") < 60  # within a few claims of its touch
    else:
        assert keys.index("t:quiet:1") == 300  # behind the whole import


class Running:
    """Runs of each tenant in flight, and the most seen at once."""

    def __init__(self) -> None:
        self.now: dict[str, int] = defaultdict(int)
        self.most: dict[str, int] = defaultdict(int)

    def enter(self, claim: Claim) -> None:
        self.now[org(claim)] += 1
        self.most[org(claim)] = max(self.most[org(claim)], self.now[org(claim)])

    def leave(self, claim: Claim) -> None:
        self.now[org(claim)] -= 1


async def test_max_running_holds_for_a_leading_rule_and_other_tenants_go_on(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = fair_setup(tmp_path, namespace, fair='{by: "{org}", max_running: 2}',
                           concurrency=6)
    rec.clock = lambda: server_ms(redis_client)
    running, gate = Running(), asyncio.Event()

    async def hold_import(claim: Claim) -> None:
        running.enter(claim)
        try:
            if org(claim) == "import":
                await gate.wait()
        finally:
            running.leave(claim)

    rec.hook = hold_import
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch_many(f"t:import:{i}" for i in range(10))
    await c.flush()
    await wait_until(lambda: running.now["import"] == 2, message="two import runs held")
    c.touch_many(["t:quiet:1", "t:quiet:2"])
    await c.flush()
    await wait_until(lambda: len(rec.of("t:quiet:1")) + len(rec.of("t:quiet:2")) == 2,
                     message="the quiet tenant's leading runs, the import's held at its cap")
    assert running.now["import"] == 2 and len(rec.calls) == 4
    held = rec.calls[0].key
    waiting = next(f"t:import:{i}" for i in range(10)
                   if f"t:import:{i}" not in {call.key for call in rec.calls})
    before = await server_ms(redis_client)
    c.touch(held)  # during its leading run
    c.touch(waiting)  # its leading run waits at the cap: the touch joins it
    await c.flush()
    gate.set()
    await quiet_down(redis_client, namespace)

    assert running.most["import"] == 2
    assert sorted(claim.key for claim in rec.calls) == sorted(
        [f"t:import:{i}" for i in range(10)] + [held, "t:quiet:1", "t:quiet:2"])
    first, second = rec.of(held)
    assert leads(first) and not leads(second)
    assert second.due_ms >= second.last_touch_ms + WINDOW_MS
    assert sum(not leads(claim) for claim in rec.calls) == 1
    (joined,) = rec.of(waiting)
    assert leads(joined) and joined.first_touch_ms <= before <= joined.last_touch_ms


# -- the outbox -------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutboxDb]:
    url = request.getfixturevalue("postgres").url if request.param == "postgresql" else None
    found = new_outbox(request.param, tmp_path, url)
    yield found
    found.table.drop(found.engine)
    found.engine.dispose()


def write_rows(outbox: OutboxDb, *rows: tuple[str, str]) -> None:
    """One transaction of the application writing ``(key, item)`` rows."""
    with Session(outbox.engine) as session:
        for key, item in rows:
            touch_in_transaction(session, key, item=item, table=outbox.table)
        session.commit()


async def test_outbox_rows_of_a_quiet_key_lead_and_rows_during_its_run_make_one_more(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        *, outbox: OutboxDb, start: Start) -> None:
    # ``outbox`` before ``start``: the node stops before the table is dropped (a DROP
    # waits for the node's claim, whose COMMIT waits for this thread's event loop)
    text = RULES.format(ns=namespace, window="300ms", max_wait="2s") + outbox.source(
        poll="20ms")
    path, rec = recorder_rules(tmp_path, f"leadoutbox_{namespace}_{outbox.kind}", text)
    gate = asyncio.Event()

    async def hold_first(claim: Claim) -> None:
        if claim.key == "lead:1" and len(rec.of("lead:1")) == 1:
            await gate.wait()

    rec.hook = hold_first
    await start(path, redis_url=redis_url, node_id="n1")
    write_rows(outbox, ("lead:1", "first"), ("lead:2", "only"))
    await wait_until(lambda: len(rec.calls) == 2, timeout=15,
                     message="both keys' leading refreshes")
    for n in range(3):
        write_rows(outbox, ("lead:1", f"during-{n}"))
    await wait_until(lambda: outbox.rows() == 0, message="the rows touched")
    gate.set()
    await quiet_down(redis_client, namespace)

    (only,) = rec.of("lead:2")
    first, second = rec.of("lead:1")
    assert leads(first) and leads(only)
    assert (list(first.items), list(only.items)) == (["first"], ["only"])
    assert not leads(second) and second.due_ms >= second.last_touch_ms + WINDOW_MS
    assert list(second.items) == [f"during-{n}" for n in range(3)]
