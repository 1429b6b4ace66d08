"""`coalescer run --http` on an address open to the network: refused without a token
unless --insecure-no-token says it is meant (that it then starts, with a warning, and
with a token without one: tests/cli/test_messages.py, on a port taken on loopback so
that the API is never actually open to the network in a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalescer.cli.parser import build_parser
from coalescer.cli.supervisor import plan_from_args
from tests.cli.test_main import cli, write_rules


@pytest.mark.parametrize("extra", [[], ["--processes", "2"]], ids=["one", "supervised"])
def test_run_on_an_open_address_without_a_token_exits_1_naming_the_fixes(
        tmp_path: Path, namespace: str, redis_url: str, extra: list[str]) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("run", "--http", "0.0.0.0:0", "--rules", str(rules), "--redis", redis_url,
               *extra, cwd=tmp_path, timeout=30)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("coalescer run: refusing to serve the HTTP API on 0.0.0.0:0 "
                           "without a token")
    assert "COALESCER_TOKEN=<secret>" in line and "bind it to 127.0.0.1" in line
    assert "--insecure-no-token" in line


@pytest.mark.parametrize("flag", [True, False])
def test_supervised_children_get_the_flag_only_when_given(
        tmp_path: Path, namespace: str, flag: bool) -> None:
    rules = write_rules(tmp_path, namespace)
    args = build_parser().parse_args(["run", "--processes", "2", "--http", "0.0.0.0:8470",
                                      "--rules", str(rules),
                                      *(["--insecure-no-token"] if flag else [])])
    plan = plan_from_args(args, ("0.0.0.0", 8470))
    assert all(("--insecure-no-token" in plan.argv(k)) is flag for k in range(2))
