"""`coalescer run --http-max-connections N --http-header-timeout S ...`: the HTTP API's
connection limits from the command line, for one node and for supervised children."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from coalescer.cli.parser import build_parser
from coalescer.cli.supervisor import plan_from_args
from tests.cli.test_main import cli, write_rules
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.servers import free_port, poll_until
from tests.web.test_connections import SLOW_HEADER, server_closed

LIMITS = ["--http-max-connections", "5", "--http-header-timeout", "1",
          "--http-body-timeout", "2s", "--http-idle-timeout", "1m"]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--http-max-connections", "1", "must be a whole number of 2 or more (one is kept for "
                                    "/healthz), not '1'"),
    ("--http-max-connections", "many", "must be a whole number of 2 or more (one is kept "
                                       "for /healthz), not 'many'"),
    ("--http-header-timeout", "0", "must be a number of seconds over 0 (or 10s, 1m), not '0'"),
    ("--http-body-timeout", "-1", "must be a number of seconds over 0 (or 10s, 1m), not '-1'"),
    ("--http-idle-timeout", "soon", "must be a number of seconds over 0 (or 10s, 1m), "
                                    "not 'soon'")])
def test_run_refuses_a_bad_http_limit_naming_the_flag(
        flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", f"{flag}={value}"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"coalescer run: error: argument {flag}: {message}")


def test_an_http_limit_with_the_http_api_off_is_refused(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("run", "--http", "off", "--http-header-timeout", "5", "--rules", str(rules),
               "--redis", redis_url, cwd=tmp_path, timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "coalescer run: --http-header-timeout limits the HTTP API, which --http off turns "
        "off: give --http HOST:PORT, or leave the limit out")


@pytest.mark.parametrize("given", [True, False])
def test_supervised_children_get_the_http_limits_given(
        tmp_path: Path, namespace: str, given: bool) -> None:
    rules = write_rules(tmp_path, namespace)
    args = build_parser().parse_args(["run", "--processes", "2", "--rules", str(rules),
                                      *(LIMITS if given else [])])
    plan = plan_from_args(args, ("127.0.0.1", 8470))
    for k in range(2):
        argv = plan.argv(k)
        if given:
            assert argv[-8:] == ["--http-max-connections", "5", "--http-header-timeout", "1.0",
                                 "--http-body-timeout", "2.0", "--http-idle-timeout", "60.0"]
        else:
            assert not [a for a in argv if a.startswith("--http-") and a != "--http"]


@pytest.fixture
def node(tmp_path: Path, namespace: str, redis_url: str) -> Iterator[int]:
    """A `coalescer run` process with LIMITS, once its HTTP API listens: its port."""
    rules, port, err = write_rules(tmp_path, namespace), free_port(), tmp_path / "node.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [*coalescer_cmd(), "run", "--rules", str(rules), "--redis", redis_url,
             "--http", f"127.0.0.1:{port}", *LIMITS],
            cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        poll_until(lambda: "HTTP API listening" in err.read_text() or proc.poll() is not None,
                   timeout=30, message="the HTTP API to listen")
        assert proc.poll() is None, err.read_text()
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def metric(port: int, line_start: str) -> str | None:
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return next((line for line in text.splitlines() if line.startswith(line_start)), None)


async def test_a_node_enforces_the_limits_given_on_its_command_line(node: int) -> None:
    assert await metric(node, "coalescer_http_connections_max ") == \
        "coalescer_http_connections_max 5.0"
    reader, writer = await asyncio.open_connection("127.0.0.1", node)
    try:
        writer.write(SLOW_HEADER[:20])  # and no more: closed at the 1 s header deadline,
        assert await server_closed(reader, within=5)  # well before the default 10 s
    finally:
        writer.close()
    closed = await metric(node, 'coalescer_http_connections_closed_total{reason="header_timeout"}')
    assert closed is not None and closed.endswith(" 1.0")
