"""examples/fastapi_app: its own tests pass, run as its developer runs them (``pytest`` in
the example's folder, the coalescer plugin on by default), while that developer's node of
the same rules file runs on the same Valkey: the tests' touches never reach it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import redis.asyncio

from coalescer import Coalescer
from tests.conftest import Start
from tests.helpers.e2e import REPO, clean_env
from tests.helpers.servers import wait_until

EXAMPLE = REPO / "examples" / "fastapi_app"


async def run_the_examples_tests(redis_url: str, database: Path) -> str:
    """``pytest`` in the example's folder, from a shell where $COALESCER_REDIS_URL and the
    app's database are the running deployment's; the plugin's server is that Valkey too
    ($COALESCER_TEST_REDIS_URL), so only namespaces keep the two apart. Its output."""
    env = clean_env(COALESCER_REDIS_URL=redis_url, COALESCER_TEST_REDIS_URL=redis_url,
                    RATINGS_DB=str(database), PYTHONDONTWRITEBYTECODE="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=EXAMPLE, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    return text


async def keys_of_test_namespaces(client: redis.asyncio.Redis) -> set[str]:
    """The keys of the plugin's test namespaces ("test-" and 12 hex digits) on ``client``."""
    return {key async for key in client.scan_iter(match="*test-????????????*")}


async def refreshed(node: Coalescer) -> list[str]:
    return [refresh.key for refresh in await node.query.history()]


async def test_the_examples_tests_pass_and_never_reach_the_running_deployment(
        redis_url: str, redis_client: redis.asyncio.Redis, start: Start, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    database = tmp_path / "dev-ratings.db"
    monkeypatch.setenv("RATINGS_DB", str(database))
    try:
        node = await start(EXAMPLE / "rules.yaml", redis_url=redis_url, worker=True)
        assert node.config.namespace == "fastapi_app"  # the rules file's own
        before = await keys_of_test_namespaces(redis_client)
        output = await run_the_examples_tests(redis_url, database)
        assert "2 passed" in output
        assert await keys_of_test_namespaces(redis_client) - before  # written to this Valkey
        # A touch of the deployment's own, after the tests': once the node has refreshed it,
        # any touch of the tests that had reached its namespace (due earlier) has run too.
        node.touch("rating:product:99")
        await wait_until(lambda: refreshed(node), timeout=20)
        assert await refreshed(node) == ["rating:product:99"]
    finally:
        sys.modules.pop("ratings", None)  # the handler's module, imported from the example
