"""`coalescer status` and `coalescer explain KEY` say when no worker runs, with the
command that starts one; once that command runs, they say nothing of it."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coalescer.cli.main import main
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.inspection import write
from tests.helpers.servers import poll_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 60s
    max_wait: 2m
    handler: {{mod}}:refresh
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_status_and_explain_name_the_command_that_starts_a_worker(
        tmp_path: Path, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str],
        procs: list[subprocess.Popen[bytes]]) -> None:
    rules, _ = write(tmp_path, namespace, RULES.format(ns=namespace))
    base = ("--rules", str(rules), "--redis", redis_url)
    run(capsys, "touch", *base, "stats:1")
    start = f"`coalescer run --rules {rules} --redis {redis_url}`"

    status = run(capsys, "status", *base).splitlines()
    assert next(line for line in status if line.startswith("stats ")).endswith(
        "  no worker is running for this rule")
    assert ("no worker is running: no node has renewed its lease; pending keys will not be "
            f"refreshed until one starts ({start})") in status
    explained = run(capsys, "explain", *base, "stats:1").splitlines()
    assert ("           no worker is running for this rule: pending keys will not be "
            f"refreshed until one starts ({start})") in explained
    assert json.loads(run(capsys, "explain", *base, "stats:1", "--json"))["no_worker"] is True

    words = shlex.split(start.strip("`"))  # the printed command, pasted
    procs.append(subprocess.Popen(
        [*coalescer_cmd(), *words[1:], "--http", "off", "--node-id", "pasted"],
        cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def serving() -> bool:
        found = json.loads(run(capsys, "status", *base, "--json"))
        return not found["rules"]["stats"]["no_worker"]
    poll_until(serving, timeout=30, message="the pasted command's worker")
    assert "no worker" not in run(capsys, "status", *base)
    assert "no worker" not in run(capsys, "explain", *base, "stats:1")
