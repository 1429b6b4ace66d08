"""The Node writer demo as a user runs it (``python -m examples.node_writer.demo``): a
Node.js process touches keys with the TypeScript client, the Python node the demo starts
refreshes each of them once, and the demo's namespace is deleted afterwards.

Skipped, saying why, where ``node`` or ``npm`` is missing or the client cannot be built.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import redis

from tests.helpers.e2e import REPO
from tests.helpers.node_client import unavailable

DEMO = [sys.executable, "-m", "examples.node_writer.demo"]


def test_a_node_writer_touches_and_the_python_node_refreshes_each_key_once(
        redis_url: str) -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"the Node client cannot run here: {why}")
    done = subprocess.run([*DEMO, "--redis-url", redis_url], cwd=REPO, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"Node writer: 10,\d{3} touches of 23 keys", out), out
    assert "Python node: 23 refreshes" in out
    assert "orders:shop1:9: refreshed once with the items the Node writer touched: " \
           "row-1, row-2, row-3" in out
    assert 'stats:user:later (delay "2s"): due 2000 ms after Redis took its touch' in out
    assert "every one of the 23 keys the Node writer touched was refreshed exactly once" in out
    namespace = re.search(r"namespace (demo-[0-9a-f]{8})", out)
    assert namespace, out
    with redis.Redis.from_url(redis_url) as r:
        assert r.keys(f"{namespace[1]}:*") == [], "the demo deletes its namespace's keys"


def test_without_node_it_says_what_to_install() -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    done = subprocess.run(DEMO, cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False, env=env)
    assert done.returncode == 2
    assert "node writer demo: node is not on PATH: install Node.js 18 or later" in done.stderr


def test_a_redis_it_cannot_reach_is_named_without_a_traceback() -> None:
    if unavailable() is not None:
        pytest.skip("the Node client cannot run here")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    done = subprocess.run([*DEMO, "--redis-url", url], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert f"node writer demo: could not connect to {url}" in done.stderr
    assert "Traceback" not in done.stderr
