"""The Python client passes every conformance case (conformance/), through its adapter
and the runner, against the real servers the runner starts; and the runner fails a
client that does not do what a case says."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.case_run import run_case
from conformance.servers import Servers
from conformance.vectors import Case, load

PYTHON_ADAPTER = f"{sys.executable} -m conformance.adapters.python_adapter"
REPO = Path(__file__).resolve().parents[2]
CASES = load()

# an adapter that answers ok to everything and touches nothing
LIAR = f"""{sys.executable} -c '
import json, sys
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps({{"id": request["id"], "ok": True, "touched": 1}}), flush=True)
'"""


def _param(case: Case) -> object:
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    started = Servers(tmp_path_factory.mktemp("conformance"))
    yield started
    started.stop()


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
async def test_the_python_client_passes(case: Case, servers: Servers) -> None:
    result = await run_case(case, PYTHON_ADAPTER, servers)
    assert result.ok, f"{result.message}\nadapter stderr:\n{result.stderr}"


async def test_a_client_that_writes_nothing_fails_with_what_redis_holds(
        servers: Servers) -> None:
    case = next(c for c in CASES if c.name.startswith("one touch is pending"))
    result = await run_case(case, LIAR, servers)
    assert not result.ok
    assert "stats:1: state is 'idle', expected 'pending'" in result.message


async def test_a_client_that_gives_no_answer_fails_naming_the_request(
        servers: Servers) -> None:
    case = next(c for c in CASES if c.name.startswith("one touch is pending"))
    result = await run_case(case, f"{sys.executable} -c 'print(\"not json\")'", servers)
    assert not result.ok
    assert "an answer that is not JSON: b'not json\\n'" in result.message


def test_the_command_line_runs_a_level_and_says_what_passed() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conformance.run", "--adapter", PYTHON_ADAPTER, "--json",
         "--case", "an op before open is refused", "--case", "a time in the past is due now"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["case"], r["ok"]) for r in lines] == [
        ("level0: a time in the past is due now", True),
        ("level0: an op before open is refused", True)]


def test_the_command_line_fails_for_a_failing_client() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conformance.run", "--adapter", LIAR,
         "--case", "one touch is pending, due a window after the server took it"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 1
    assert "FAIL  level0: one touch is pending" in done.stdout
    assert "0 of 1 cases passed" in done.stdout


async def test_a_namespace_in_the_environment_does_not_reach_the_adapter(
        servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_NAMESPACE", "someone-elses")
    case = next(c for c in CASES if c.name.startswith("one touch is pending"))
    result = await run_case(case, PYTHON_ADAPTER, servers)
    assert result.ok, result.message
