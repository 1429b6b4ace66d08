"""``isolation: process``: a rule's sync handler runs in a child process, which is
killed at the run's timeout and at the end of the shutdown grace; the child's
exceptions, and its own death, are the run's failure; a child is reused between runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coalescer import Coalescer
from coalescer.query.history import HistoryQuery, Refresh
from tests.conftest import RulesFactory, Start
from tests.helpers.servers import wait_until

HANDLERS = """\
import ctypes
import os
import pathlib
import signal
import time

HERE = pathlib.Path(__file__).parent

def warm(claim):
    # note the child's pid; True for a warm-up key (which does nothing else)
    (HERE / f"pid-{claim.key}-{claim.attempt}").write_text(str(os.getpid()))
    return claim.key.startswith("warm:")

def spin(claim):
    if warm(claim):
        return
    # only SIGKILL ends it (libc's signal(): a handler runs on a thread of its child,
    # where Python's signal.signal is refused)
    ctypes.CDLL(None).signal(signal.SIGTERM, ctypes.c_void_p(1))  # SIG_IGN
    while True:
        time.sleep(0.02)

def fail(claim):
    if not warm(claim):
        raise ValueError(f"bad input for {claim.key}")

def die(claim):
    if not warm(claim) and claim.attempt == 1:
        os._exit(3)

def hang(claim):
    warm(claim)
    while True:
        time.sleep(0.02)

def env(claim):
    if not warm(claim):
        (HERE / f"env-{claim.key}").write_text(os.environ.get("ISO_MARK", "-"))

def hold(claim):
    # its first attempt waits (until its child is killed); a retry returns
    warm(claim)
    while claim.attempt == 1:
        time.sleep(0.02)
"""

RULES = """\
namespace: {ns}
rules:
  - name: iso
    match: "{{how}}:{{id}}"
    window: 100ms
    timeout: {timeout}
    retry: {{attempts: 2, backoff: 50ms, max_backoff: 50ms}}
    isolation: process
    handler: handlers:{handler}
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _pid(folder: Path, key: str, attempt: int) -> int:
    path = folder / f"pid-{key}-{attempt}"
    await wait_until(path.exists, message=f"{key}'s handler started (attempt {attempt})")
    return int(await wait_until(path.read_text, message=f"the pid of {key}"))


async def _node(start: Start, rules_file: RulesFactory, namespace: str, redis_url: str, *,
                handler: str, timeout: str = "30s", grace: float = 2.0) -> Coalescer:
    path = rules_file(RULES.format(ns=namespace, handler=handler, timeout=timeout), HANDLERS)
    c = await start(path, redis_url=redis_url, grace=grace)
    c.touch("warm:0")  # the rule's first child started: later runs reuse it
    await wait_until((path.parent / "pid-warm:0-1").exists, message="a warm child")
    return c


async def _failures(c: Coalescer, key: str, count: int) -> list[Refresh]:
    async def failed() -> list[Refresh] | None:
        found = [r for r in await c.query.history(HistoryQuery(key=key)) if r.failed]
        return found if len(found) >= count else None
    found: list[Refresh] = await wait_until(failed, message=f"{count} failures of {key}")
    return found


async def test_a_handler_that_never_returns_is_killed_at_its_timeout_and_retried(
        start: Start, rules_file: RulesFactory, tmp_path: Path, namespace: str,
        redis_url: str) -> None:
    c = await _node(start, rules_file, namespace, redis_url, handler="spin",
                    timeout="1500ms")  # time for the first child to start on a busy machine
    c.touch("spin:1")
    first = await _pid(tmp_path, "spin:1", 1)
    await wait_until(lambda: _gone(first), message="the first child killed")
    second = await _pid(tmp_path, "spin:1", 2)
    assert second != first  # the killed child was replaced
    await wait_until(lambda: _gone(second), message="the second child killed")
    failures = await _failures(c, "spin:1", 2)
    assert [f.error for f in failures] == ["TimeoutError: handler ran past its timeout "
                                           "of 1.5s"] * 2
    page = await c.query.dead_letters(["spin:1"])
    assert [e["error"] for e in page.entries] == [failures[0].error]


async def test_an_exception_in_the_child_is_the_runs_failure_and_the_child_is_reused(
        start: Start, rules_file: RulesFactory, tmp_path: Path, namespace: str,
        redis_url: str) -> None:
    c = await _node(start, rules_file, namespace, redis_url, handler="fail")
    c.touch("fail:1")
    failures = await _failures(c, "fail:1", 2)
    assert {f.error for f in failures} == {"ValueError: bad input for fail:1"}
    pids = {await _pid(tmp_path, "warm:0", 1), await _pid(tmp_path, "fail:1", 1),
            await _pid(tmp_path, "fail:1", 2)}
    assert len(pids) == 1 and pids != {os.getpid()}


async def test_a_child_that_dies_fails_its_run_and_is_replaced(
        start: Start, rules_file: RulesFactory, tmp_path: Path, namespace: str,
        redis_url: str) -> None:
    c = await _node(start, rules_file, namespace, redis_url, handler="die")
    c.touch("die:1")

    async def refreshed() -> list[Refresh]:
        return [r for r in await c.query.history(HistoryQuery(key="die:1"))
                if r.outcome == "success"]
    await wait_until(refreshed, message="die:1 refreshed on its second attempt")
    failure, = [r for r in await c.query.history(HistoryQuery(key="die:1")) if r.failed]
    dead = await _pid(tmp_path, "die:1", 1)
    assert failure.error == (f"ChildDied: the handler's child process {dead} ended "
                             "(exit code 3)")
    assert await _pid(tmp_path, "die:1", 2) != dead


async def test_the_child_of_a_run_past_the_grace_is_killed_at_shutdown(
        start: Start, rules_file: RulesFactory, tmp_path: Path, namespace: str,
        redis_url: str) -> None:
    c = await _node(start, rules_file, namespace, redis_url, handler="spin", grace=0.3)
    c.touch("spin:1")
    running = await _pid(tmp_path, "spin:1", 1)
    c.touch("warm:1")  # a second child, idle once this run ends
    idle = await _pid(tmp_path, "warm:1", 1)
    assert idle != running
    await c.close()
    await wait_until(lambda: _gone(running), message="the child killed at the end of the grace")
    await wait_until(lambda: _gone(idle), message="the idle child stopped at close")


SHARED = """\
namespace: {ns}
defaults:
  window: 100ms
  concurrency: 1
rules:
  - name: hangs
    match: "hang:{{id}}"
    timeout: 3s
    retry: {{attempts: 1}}
    handler: handlers:hang
  - name: holds
    match: "hold:{{id}}"
    timeout: 60s
    retry: {{attempts: 2, backoff: 50ms, max_backoff: 50ms}}
    handler: handlers:hold
"""


async def test_a_run_sharing_the_child_of_a_run_killed_at_its_timeout_is_retried(
        start: Start, rules_file: RulesFactory, tmp_path: Path, namespace: str,
        redis_url: str) -> None:
    # two rules of concurrency 1: a pool of 2 runs at once, in one child
    c = await start(rules_file(SHARED.format(ns=namespace), HANDLERS), redis_url=redis_url)
    c.touch("hang:1")
    child = await _pid(tmp_path, "hang:1", 1)
    c.touch("hold:1")
    assert await _pid(tmp_path, "hold:1", 1) == child  # both runs in the one child

    async def refreshed() -> list[Refresh]:
        return [r for r in await c.query.history(HistoryQuery(key="hold:1"))
                if r.outcome == "success"]
    await wait_until(refreshed, message="hold:1 refreshed on its second attempt")
    assert _gone(child)
    failure, = [r for r in await c.query.history(HistoryQuery(key="hold:1")) if r.failed]
    assert failure.error == (f"ChildDied: the handler's child process {child} was stopped "
                             "with the run of hang:1 (its timeout or its claim lost)")
    assert await _pid(tmp_path, "hold:1", 2) != child  # its retry ran in a new child
    hung, = await _failures(c, "hang:1", 1)
    assert hung.error == "TimeoutError: handler ran past its timeout of 3s"


async def test_a_child_sees_the_environment_its_node_had_when_it_started_the_child(
        start: Start, rules_file: RulesFactory, namespace: str, redis_url: str, *,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ISO_MARK", "first")
    c = await _node(start, rules_file, namespace, redis_url, handler="env")
    folder = tmp_path
    c.touch("env:1")
    assert await wait_until(lambda: _read(folder / "env-env:1")) == "first"
    await c.close()
    monkeypatch.setenv("ISO_MARK", "second")  # the fork server was started before
    c = await _node(start, rules_file, namespace, redis_url, handler="env")
    c.touch("env:2")
    assert await wait_until(lambda: _read(folder / "env-env:2")) == "second"


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
