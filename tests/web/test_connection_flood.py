"""A real connection flood against a real node started with a low file limit: the
node keeps answering /healthz and authorised touches, closes the excess where
sockets are accepted, and logs the flood in a few lines, not a traceback a socket."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.helpers.e2e import REPO, clean_env, coalescer_cmd, line_rules, read_lines
from tests.helpers.servers import free_port, poll_until, wait_until
from tests.web.test_api import metric
from tests.web.test_connections import SLOW_HEADER, server_closed

NOFILE = 256  # the node's file limit (soft and hard)
FLOOD = 400  # sockets held open with half a request header: over the limit
TOKEN = "fl00d-test-token"
HALF_HEADER = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

RULES = """\
namespace: {ns}
defaults:
  window: 100ms
  max_wait: 1s
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


@dataclass
class NodeProcess:
    proc: subprocess.Popen[bytes]
    port: int
    stderr: Path
    refreshes: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_lines(self) -> list[str]:
        return self.stderr.read_text(errors="replace").splitlines()


def with_file_limit(limit: int, command: list[str]) -> list[str]:
    """``command`` run with a file limit of ``limit`` (set, then exec: no preexec_fn)."""
    setup = ("import os, resource, sys; "
             f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
             "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", setup, *command]


def start(command: list[str], cwd: Path, env: dict[str, str],
          stderr: Path) -> subprocess.Popen[bytes]:
    """``command`` with a file limit of 256, once its HTTP API listens."""
    with stderr.open("wb") as err:
        proc = subprocess.Popen(with_file_limit(NOFILE, command), cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        poll_until(lambda: "HTTP API listening" in stderr.read_text() or proc.poll() is not None,
                   timeout=30, message="the HTTP API to listen")
        assert proc.poll() is None, stderr.read_text()
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def node(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[NodeProcess]:
    """`coalescer run` with a token and a file limit of 256, its HTTP API on loopback."""
    rules = line_rules(tmp_path, f"lines_{namespace}", RULES.format(ns=namespace))
    port, refreshes, stderr = free_port(), tmp_path / "refreshes.log", tmp_path / "node.err"
    env = clean_env(COALESCER_TOKEN=TOKEN, E2E_NODE="n1", E2E_LOG=str(refreshes))
    command = [*coalescer_cmd(), "run", "--redis", redis_url, "--rules", str(rules),
               "--http", f"127.0.0.1:{port}"]
    proc = start(command, tmp_path, env, stderr)
    try:
        yield NodeProcess(proc, port, stderr, refreshes)
    finally:
        stop(proc)


async def _stalled_socket(port: int) -> asyncio.StreamWriter | None:
    """A connection that sends half a request header and stalls (None: not connected).
    Not drained: the node may close it first, and it still counts in the flood."""
    try:
        async with asyncio.timeout(5):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError):
        return None
    writer.write(HALF_HEADER)
    return writer


async def _close_all(writers: list[asyncio.StreamWriter | None]) -> None:
    for writer in writers:
        if writer is not None:
            writer.transport.abort()


async def _get(http: aiohttp.ClientSession, url: str, **kwargs: object) -> tuple[int, str]:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5), **kwargs) as response:
        return response.status, await response.text()


async def test_a_flood_of_stalled_connections_leaves_healthz_and_touches_answering(
        node: NodeProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    writers = await asyncio.gather(*(_stalled_socket(node.port) for _ in range(FLOOD)))
    try:
        assert sum(w is not None for w in writers) > NOFILE  # a flood over the file limit
        async with aiohttp.ClientSession() as http:
            assert await _get(http, node.url + "/healthz") == (200, '{"ok": true}')
            async with http.post(node.url + "/touch", json={"keys": ["item:1"]}, headers=auth,
                                 timeout=aiohttp.ClientTimeout(total=5)) as response:
                assert (response.status, await response.json()) == (202, {"accepted": 1})
            await wait_until(lambda: any(line[0] == "done" and line[2] == "item:1"
                                         for line in read_lines(node.refreshes)),
                             timeout=10, message="the touched key to be refreshed")
            status, metrics = await _get(http, node.url + "/metrics", headers=auth)
            assert status == 200
            assert "coalescer_http_connections_closed_total" in metrics
    finally:
        await _close_all(writers)
    summary = poll_until(lambda: [line for line in node.log_lines()
                                  if "HTTP API, last 10 s: " in line and "over the cap" in line],
                         timeout=15, message="the flood's summary line")
    lines = node.log_lines()
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines[:40])
    assert len(lines) < 20, "\n".join(lines[:40])
    assert all(" WARNING " in line for line in summary)


async def test_accepts_failing_for_want_of_file_descriptors_are_summarised_not_a_traceback_each(
        tmp_path: Path) -> None:
    """A cap set over what the file limit allows: accept() fails (EMFILE), and asyncio
    would log a traceback for every failure, hundreds a second."""
    port, stderr = free_port(), tmp_path / "api.err"
    options = json.dumps({"max_connections": 1000})
    proc = start([sys.executable, "-m", "tests.helpers.http_node", str(port), options],
                 REPO, clean_env(), stderr)
    try:
        writers = await asyncio.gather(*(_stalled_socket(port) for _ in range(FLOOD)))
        try:
            assert sum(w is not None for w in writers) > NOFILE
            summary = poll_until(
                lambda: [line for line in stderr.read_text().splitlines()
                         if "HTTP API, last " in line and "accepts failed" in line],
                timeout=15, message="the summary of failed accepts")
        finally:
            await _close_all(writers)
    finally:
        stop(proc)
    lines = stderr.read_text().splitlines()
    assert "Too many open files: raise the file limit (ulimit -n)" in summary[0]
    assert [line for line in lines if "max_connections=1000 is more than a file limit of "
            f"{NOFILE} leaves room for (64)" in line]
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines[:40])
    assert len(lines) < 10, "\n".join(lines[:40])


async def test_a_slowloris_header_is_closed_by_a_node_process_at_its_deadline(
        tmp_path: Path) -> None:
    port, stderr = free_port(), tmp_path / "api.err"
    options = json.dumps({"header_timeout": 1})
    proc = start([sys.executable, "-m", "tests.helpers.http_node", str(port), options],
                 REPO, clean_env(), stderr)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sent = 0
        try:
            while sent < len(SLOW_HEADER) and not await server_closed(reader, within=0.5):
                writer.write(SLOW_HEADER[sent:sent + 1])  # a byte every 0.5 s
                sent += 1
        finally:
            writer.transport.abort()
        assert 2 <= sent < len(SLOW_HEADER) // 2  # about 1 s of bytes, then EOF
        async with aiohttp.ClientSession() as http:
            assert await _get(http, f"http://127.0.0.1:{port}/healthz") == (200, '{"ok": true}')
    finally:
        stop(proc)
    lines = stderr.read_text().splitlines()
    assert [line for line in lines if re.search(r"HTTP API, last \d+ s: 1 connection closed "
                                                r"with request headers unfinished after 1 s$",
                                                line)]


def _evicted(metrics: str) -> float:
    return metric(metrics, "coalescer_http_connections_closed_total", reason="evicted")


async def test_a_flood_that_reconnects_as_soon_as_it_is_closed_leaves_healthz_answering(
        node: NodeProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    flood = subprocess.Popen([sys.executable, "-m", "tests.helpers.flood", str(node.port),
                              "300", "60"], cwd=REPO, stdout=subprocess.PIPE)
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection each probe
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            async def evicted() -> float:
                status, text = await _get(http, node.url + "/metrics", headers=auth)
                assert status == 200
                return _evicted(text)

            async def evicted_over(n: float) -> bool:
                return await evicted() > n

            await wait_until(lambda: evicted_over(FLOOD), timeout=30, message="the flood")
            for _ in range(10):
                before = await evicted()
                assert await _get(http, node.url + "/healthz") == (200, '{"ok": true}')
                await wait_until(lambda before=before: evicted_over(before + 50), timeout=30,
                                 message="the flood to go on")
    finally:
        flood.terminate()
        out, _ = flood.communicate(timeout=30)
    assert int(out) > 1000  # connections the flood opened
    lines = node.log_lines()
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines[:40])
    assert len(lines) < 20, "\n".join(lines[:40])
