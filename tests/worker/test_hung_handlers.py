"""A plain (sync) handler on threads (``isolation: thread``) that never returns costs its
own slot: other rules' handlers still run, its key never runs twice at once on the node,
a claim that never got to run is not reported as timed out, and a node with such a
handler still exits after SIGTERM and its grace."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from coalescer import Coalescer
from coalescer.query.history import HistoryQuery, Refresh
from tests.conftest import RulesFactory, Start
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.servers import poll_until, wait_until

HANDLERS = """\
import threading

release = threading.Event()
lock = threading.Lock()
entered = []  # the key of each run of hang() that started
running = {}  # runs of each key going on now
overlaps = []  # keys that had two runs at once
done = []  # keys refreshed by healthy()

def hang_keys(keys):
    with lock:
        for key in keys:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlaps.append(key)
            entered.append(key)
    try:
        release.wait()
    finally:
        with lock:
            for key in keys:
                running[key] -= 1

def hang(claim):
    hang_keys([claim.key])

def hang_batch(claims):
    hang_keys([claim.key for claim in claims])

def healthy(claim):
    done.append(claim.key)
"""

RULES = """\
namespace: {ns}
rules:
  - name: hung
    match: "hung:{{id}}"
    window: 100ms
    timeout: 300ms
    concurrency: 2
    retry: {{attempts: {attempts}, backoff: 50ms, max_backoff: 50ms}}
    handler: handlers:hang
    isolation: thread
  - name: healthy
    match: "ok:{{id}}"
    window: 100ms
    timeout: 1s
    concurrency: 2
    retry: {{attempts: 2, backoff: 50ms, max_backoff: 50ms}}
    handler: handlers:healthy
    isolation: thread
"""


@pytest.fixture
def handlers() -> Iterator[list[ModuleType]]:
    """The test's handlers module once a node imported it; its hung runs are released
    at teardown, before the node closes."""
    found: list[ModuleType] = []
    yield found
    for module in found:
        module.release.set()


async def _started(start: Start, rules_file: RulesFactory, namespace: str, redis_url: str,
                   handlers: list[ModuleType], *, attempts: int) -> Coalescer:
    path = rules_file(RULES.format(ns=namespace, attempts=attempts), HANDLERS)
    c = await start(path, redis_url=redis_url)
    handlers.append(sys.modules["handlers"])
    return c


async def _failures(c: Coalescer, rule: str) -> list[Refresh]:
    return [r for r in await c.query.history(HistoryQuery(rule=rule, limit=200)) if r.failed]


async def _failed_at_least(c: Coalescer, rule: str, count: int) -> list[Refresh]:
    async def enough() -> list[Refresh] | None:
        found = await _failures(c, rule)
        return found if len(found) >= count else None
    found: list[Refresh] = await wait_until(enough, message=f"{count} failures of {rule}")
    return found


async def test_hung_handlers_of_one_rule_leave_other_rules_refreshed(
        start: Start, rules_file: RulesFactory, namespace: str, redis_url: str,
        handlers: list[ModuleType]) -> None:
    c = await _started(start, rules_file, namespace, redis_url, handlers, attempts=20)
    c.touch_many(["hung:1", "hung:2"])
    await _failed_at_least(c, "hung", 4)  # both timed out, and were retried
    healthy = [f"ok:{n}" for n in range(10)]
    c.touch_many(healthy)
    module = handlers[0]
    await wait_until(lambda: set(module.done) == set(healthy),
                     message="every healthy key refreshed")
    assert not await _failures(c, "healthy")


async def test_a_timed_out_run_still_going_is_not_started_again_on_the_node(
        start: Start, rules_file: RulesFactory, namespace: str, redis_url: str,
        handlers: list[ModuleType]) -> None:
    c = await _started(start, rules_file, namespace, redis_url, handlers, attempts=20)
    c.touch("hung:1")
    failed = await _failed_at_least(c, "hung", 3)
    assert "ran past its timeout" in failed[-1].error  # recorded while its thread runs on
    module = handlers[0]
    module.release.set()
    async def refreshed() -> bool:
        history = await c.query.history(HistoryQuery(key="hung:1", limit=100))
        return any(r.outcome == "success" for r in history)
    await wait_until(refreshed, message="hung:1 refreshed once its thread returned")
    assert module.overlaps == []
    assert module.entered.count("hung:1") >= 2


BATCH_RULES = """\
namespace: {ns}
rules:
  - name: hung
    match: "hung:{{id}}"
    window: 100ms
    timeout: 300ms
    concurrency: 1
    batch: {{max: 2}}
    retry: {{attempts: 20, backoff: 50ms, max_backoff: 50ms}}
    handler: handlers:hang_batch
    isolation: thread
"""


async def test_a_timed_out_batch_call_still_going_holds_its_keys_until_it_returns(
        start: Start, rules_file: RulesFactory, namespace: str, redis_url: str,
        handlers: list[ModuleType]) -> None:
    c = await start(rules_file(BATCH_RULES.format(ns=namespace), HANDLERS),
                    redis_url=redis_url)
    module = sys.modules["handlers"]
    handlers.append(module)
    keys = ["hung:1", "hung:2"]
    c.touch_many(keys)
    failed = await _failed_at_least(c, "hung", 4)
    assert any(f.error.startswith("NotStartedError: never started") for f in failed)
    module.release.set()

    async def refreshed() -> bool:
        history = await c.query.history(HistoryQuery(rule="hung", limit=100))
        return {r.key for r in history if r.outcome == "success"} == set(keys)
    await wait_until(refreshed, message="both keys refreshed once the call returned")
    assert module.overlaps == []


async def test_a_claim_that_never_started_is_not_dead_lettered_as_timed_out(
        start: Start, rules_file: RulesFactory, namespace: str, redis_url: str,
        handlers: list[ModuleType]) -> None:
    c = await _started(start, rules_file, namespace, redis_url, handlers, attempts=3)
    keys = ["hung:1", "hung:2"]
    c.touch_many(keys)

    async def dead() -> list[dict[str, object]] | None:
        page = await c.query.dead_letters(keys)
        return page.entries if len(page.entries) == len(keys) else None
    letters = await wait_until(dead, message="both keys dead-lettered")
    module = handlers[0]
    assert sorted(module.entered) == keys  # each handler started once, and never returned
    for letter in letters:
        assert str(letter["error"]).startswith("NotStartedError: never started"), letter
    timeouts = [r for r in await _failures(c, "hung") if "ran past its timeout" in r.error]
    assert len(timeouts) == len(module.entered)


HUNG_NODE_RULES = """\
namespace: {ns}
rules:
  - name: hung
    match: "hung:{{id}}"
    window: 100ms
    timeout: 300ms
    handler: stuck:hang
    isolation: thread
"""

STUCK = """\
import pathlib
import threading

def hang(claim):
    pathlib.Path(__file__).with_name("entered").write_text(claim.key)
    threading.Event().wait()
"""


def test_a_node_with_a_hung_sync_handler_exits_after_sigterm_and_its_grace(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    (tmp_path / "stuck.py").write_text(textwrap.dedent(STUCK))
    rules = tmp_path / "rules.yaml"
    rules.write_text(HUNG_NODE_RULES.format(ns=namespace))
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        node = subprocess.Popen(
            [*coalescer_cmd(), "run", "--rules", str(rules), "--redis", redis_url,
             "--http", "off", "--grace", "1"], cwd=tmp_path, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, env=clean_env())
    try:
        poll_until(lambda: "running" in log.read_text(), message="the node started")
        touch = subprocess.run([*coalescer_cmd(), "touch", "hung:1", "--rules", str(rules),
                                "--redis", redis_url], capture_output=True, text=True,
                               check=False, env=clean_env())
        assert touch.returncode == 0, touch.stderr
        poll_until((tmp_path / "entered").exists, message="the handler started")
        node.send_signal(signal.SIGTERM)
        poll_until(lambda: node.poll() is not None, timeout=30.0,
                   message="the node exited after SIGTERM")
        text = log.read_text()
        assert node.returncode == 0, text
        abandoned = [line for line in text.splitlines() if "abandoning" in line]
        assert len(abandoned) == 1 and "hung:1" in abandoned[0], text
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
