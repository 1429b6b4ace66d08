"""`coalescer pause`, `resume` and `run-now`, run as real child processes against a
`coalescer run` node on a real valkey-server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_main import cli
from tests.helpers.e2e import NodeProcs, line_rules, read_lines
from tests.helpers.servers import poll_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 1s
defaults:
  window: 50ms
  max_wait: 2s
  absorb: 5ms
  retry: {{attempts: 1, backoff: 20ms, max_backoff: 50ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
  - name: slow
    match: "slow:{{id}}"
    window: 1h
    max_wait: 2h
    handler: {{mod}}:refresh
  - name: other
    match: "other:*"
    handler: {{mod}}:refresh
"""


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[NodeProcs]:
    started = NodeProcs(tmp_path)
    yield started
    started.stop_all()


def started_keys(log: Path) -> list[str]:
    return [key for phase, _, key, _, _ in read_lines(log) if phase == "done"]


@pytest.mark.slow  # some 7-10 s: with the long scenarios, out of the quick run
def test_pause_holds_a_rule_on_a_running_node_and_resume_runs_its_keys(
        tmp_path: Path, namespace: str, redis_url: str, procs: NodeProcs) -> None:
    rules = line_rules(tmp_path, f"ctl_{namespace}", RULES.format(ns=namespace))
    log = tmp_path / "lines.log"
    procs.start(rules, redis_url, "n1", E2E_LOG=str(log))
    common = ("--rules", str(rules), "--redis", redis_url)
    paused = cli("pause", "item", *common, cwd=tmp_path)
    assert paused.returncode == 0, paused.stderr
    assert "paused rule item on every node" in paused.stdout
    assert "coalescer resume" in paused.stdout
    again = cli("pause", "item", *common, "--json", cwd=tmp_path)
    assert json.loads(again.stdout) == {"rule": "item", "paused": True, "changed": False}

    assert cli("touch", "item:1", "item:2", *common, cwd=tmp_path).returncode == 0
    assert cli("touch", "other:1", *common, cwd=tmp_path).returncode == 0
    poll_until(lambda: "other:1" in started_keys(log), message="other:1 refreshed")
    assert [k for k in started_keys(log) if k.startswith("item:")] == []

    status = cli("status", *common, "--json", cwd=tmp_path)
    assert json.loads(status.stdout)["rules"]["item"]["paused"] is True
    text = cli("status", *common, cwd=tmp_path).stdout
    assert "paused: no key runs until it is resumed" in next(
        line for line in text.splitlines() if line.startswith("item "))
    explained = cli("explain", "item:1", *common, cwd=tmp_path).stdout
    assert "pending, but its rule is paused" in explained

    resumed = cli("resume", "item", *common, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed rule item" in resumed.stdout
    poll_until(lambda: {"item:1", "item:2"} <= set(started_keys(log)),
               message="the paused keys refreshed")


def test_run_now_runs_a_key_an_hour_early_and_names_the_rest(
        tmp_path: Path, namespace: str, redis_url: str, procs: NodeProcs) -> None:
    rules = line_rules(tmp_path, f"ctl_{namespace}", RULES.format(ns=namespace))
    log = tmp_path / "lines.log"
    procs.start(rules, redis_url, "n1", E2E_LOG=str(log))
    common = ("--rules", str(rules), "--redis", redis_url)
    assert cli("touch", "slow:1", *common, cwd=tmp_path).returncode == 0
    done = cli("run-now", "slow:1", "slow:2", *common, "--json", cwd=tmp_path)
    assert done.returncode == 1
    assert json.loads(done.stdout) == {"run": ["slow:1"], "not_pending": ["slow:2"],
                                       "states": {"slow:1": "hastened", "slow:2": "idle"}}
    assert "'slow:2' is not pending; it is idle" in done.stderr
    poll_until(lambda: "slow:1" in started_keys(log), message="slow:1 refreshed")


def test_the_controls_refuse_an_unknown_rule_or_key(tmp_path: Path, namespace: str,
                                                   redis_url: str) -> None:
    rules = line_rules(tmp_path, f"ctl_{namespace}", RULES.format(ns=namespace))
    common = ("--rules", str(rules), "--redis", redis_url)
    for action in ("pause", "resume"):
        done = cli(action, "nope", *common, cwd=tmp_path)
        assert done.returncode == 1
        assert f"coalescer {action}: no rule named 'nope'" in done.stderr
        assert "its rules: item, slow, other" in done.stderr
    done = cli("run-now", "slow:1", "nomatch", *common, cwd=tmp_path)
    assert done.returncode == 2
    assert "no rule in" in done.stderr and "'nomatch'" in done.stderr
    assert "nothing was run" in done.stderr
