"""Keys touched over HTTP with terminal escape sequences and line breaks in them cannot
clear an operator's screen, set their clipboard or forge lines in any text output of
the CLI; ``--json`` keeps the exact values."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio

from coalescer import Coalescer
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from tests.cli.test_main import cli
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
defaults:
  window: 20ms
  max_wait: 1s
  absorb: 5ms
  retry: {{attempts: 1, backoff: 50ms, max_backoff: 50ms}}
rules:
  - name: any
    match: "*"
    handler: {module}:refresh
"""

HANDLER = """\
def refresh(claim):
    raise RuntimeError("cannot refresh " + claim.key + "\\x1b]52;c;ZXZpbA==\\x07 done")
"""

FORGED = ("boom:\x1b[2J\x1b[H", "any:\x1b]52;c;aGVsbG8=\x07", "any:line1\nFAKE LOG LINE")
RAW = ("\x1b", "\x07", "\nFAKE LOG LINE")


@pytest_asyncio.fixture
async def dead_forged_keys(redis_url: str, namespace: str, tmp_path: Path,
                           caplog: pytest.LogCaptureFixture) -> AsyncIterator[Path]:
    """Rules whose namespace holds the FORGED keys, each touched over HTTP and
    dead-lettered with an error that carries an escape sequence of its own."""
    module = f"forged_{namespace}"
    (tmp_path / f"{module}.py").write_text(HANDLER)
    rules = tmp_path / "rules.yaml"
    rules.write_text(textwrap.dedent(RULES.format(ns=namespace, module=module)))
    sk = KeySpace(namespace, 1).shard(0)
    caplog.set_level(logging.INFO, logger="coalescer")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=2) as c:
        api = HttpApi(c, port=0)
        await api.start()
        try:
            async with aiohttp.ClientSession() as http, http.post(
                    f"http://127.0.0.1:{api.port}/touch",
                    json={"keys": list(FORGED)}) as response:
                assert response.status == 202, await response.text()
            client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
            try:
                async def all_dead() -> bool:
                    return await client.zcard(sk.dead("any")) == len(FORGED)
                await wait_until(all_dead, message="every forged key dead-lettered")
            finally:
                await client.aclose()
        finally:
            await api.close()
    yield rules
    sys.modules.pop(module, None)


@pytest.mark.parametrize("command", [
    ["dead", "list"], ["status"], ["history"],
    ["explain", FORGED[0]], ["explain", FORGED[1]], ["explain", FORGED[2]]])
def test_text_output_shows_control_characters_escaped(
        dead_forged_keys: Path, redis_url: str, tmp_path: Path, command: list[str]) -> None:
    done = cli(*command, "--rules", str(dead_forged_keys), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for raw in RAW:
        assert raw not in done.stdout
        assert raw not in done.stderr
    assert "\\x1b" in done.stdout


def test_cancel_names_forged_keys_that_are_not_pending_escaped(
        dead_forged_keys: Path, redis_url: str, tmp_path: Path) -> None:
    done = cli("cancel", *FORGED, "--rules", str(dead_forged_keys), "--redis", redis_url,
               cwd=tmp_path)
    assert done.returncode == 1  # dead-lettered: not pending
    for raw in RAW:
        assert raw not in done.stdout
        assert raw not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == len(FORGED)
    assert "'boom:\\x1b[2J\\x1b[H' is not pending" in lines[0]


def test_dead_list_names_each_forged_key_escaped_on_one_line(
        dead_forged_keys: Path, redis_url: str, tmp_path: Path) -> None:
    done = cli("dead", "list", "--rules", str(dead_forged_keys), "--redis", redis_url,
               cwd=tmp_path)
    lines = done.stdout.splitlines()
    assert any(line.strip().startswith("boom:\\x1b[2J\\x1b[H") for line in lines)
    assert any(line.strip().startswith("any:line1\\x0aFAKE LOG LINE") for line in lines)
    assert not any(line.startswith("FAKE LOG LINE") for line in lines)


def test_json_output_keeps_the_exact_keys_and_errors(
        dead_forged_keys: Path, redis_url: str, tmp_path: Path) -> None:
    done = cli("history", "--json", "--rules", str(dead_forged_keys), "--redis", redis_url,
               cwd=tmp_path)
    found = json.loads(done.stdout)
    assert {r["key"] for r in found} == set(FORGED)
    assert all("\x1b]52;c;ZXZpbA==\x07" in r["error"] for r in found)


def test_the_node_log_shows_forged_keys_and_errors_escaped_one_line_an_event(
        dead_forged_keys: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = caplog.get_records("setup")  # the fixture ran the node
    lines = [caplog.handler.format(r) for r in records]
    for raw in RAW:
        assert not any(raw in line for line in lines)
    events = [r for r in records
              if r.levelname == "ERROR" and " dead-lettered after " in r.getMessage()]
    assert len(events) == 1  # one line per kind of failure per period: one rule, one error
    assert all("\n" not in r.getMessage() for r in events)
