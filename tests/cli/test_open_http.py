"""`coalescer run --http` on an address open to the network: refused without a token
unless --insecure-no-token says it is meant."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from coalescer.cli.parser import build_parser
from coalescer.cli.supervisor import plan_from_args
from tests.cli.test_main import cli, start_node, stop_node, write_rules
from tests.helpers.e2e import clean_env
from tests.helpers.servers import wait_until


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


@pytest.mark.parametrize("env", [{"COALESCER_TOKEN": "s3cret"}, {}], ids=["token", "flag"])
async def test_run_on_an_open_address_starts_with_a_token_or_the_flag(
        tmp_path: Path, namespace: str, redis_url: str, env: dict[str, str]) -> None:
    rules = write_rules(tmp_path, namespace)
    flag = [] if env else ["--insecure-no-token"]
    proc, out = start_node(tmp_path, "--rules", str(rules), "--redis", redis_url,
                           "--http", "0.0.0.0:0", *flag, env=clean_env(**env))
    try:
        def port() -> int | None:
            found = re.search(r"HTTP on http://0\.0\.0\.0:(\d+)", out.read_text())
            return int(found.group(1)) if found else None

        bound = await wait_until(port, timeout=30, message="the node's HTTP address")
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{bound}/healthz") as answer:
            assert answer.status == 200
        if not env:
            assert "has no token: it is open to the network" in out.read_text()
    finally:
        assert stop_node(proc) == 0, out.read_text()


@pytest.mark.parametrize("flag", [True, False])
def test_supervised_children_get_the_flag_only_when_given(
        tmp_path: Path, namespace: str, flag: bool) -> None:
    rules = write_rules(tmp_path, namespace)
    args = build_parser().parse_args(["run", "--processes", "2", "--http", "0.0.0.0:8470",
                                      "--rules", str(rules),
                                      *(["--insecure-no-token"] if flag else [])])
    plan = plan_from_args(args, ("0.0.0.0", 8470))
    assert all(("--insecure-no-token" in plan.argv(k)) is flag for k in range(2))
