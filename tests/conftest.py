"""Shared fixtures: real valkey-server processes, namespaces, rules files.

Fixtures:
    redis_server   session   one ValkeyProcess for the whole run
    redis_url      session   its URL
    namespace      function  a unique namespace ("t" + 10 hex digits)
    redis_client   function  redis.asyncio.Redis on redis_url, decode_responses=True
    own_server     function  a fresh ValkeyProcess of the test's own (restart/kill freely)
    cluster        session   a 3-master Cluster, started only if a test asks for it
    rules_file     function  factory: rules_file(yaml_text, handlers_py=None) -> Path
    start          function  factory: await start(rules_path, **options) -> a started
                             Coalescer (grace 2 s unless given), closed at teardown
    postgres       session   a real PostgreSQL server (bench.postgres), skipped where absent
    kafka          session   a real Kafka-protocol broker (Tansu, bench.kafka_broker), skipped
                             where its binary is absent; kafka.bootstrap is its address

Long scenarios are marked slow here (``SLOW_MODULES``): ``pytest -m slow`` runs them.

Helpers (import from ``tests.helpers.servers``): ValkeyProcess, Cluster, start_cluster, wait_until,
poll_until, write_rules, free_port.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio

from bench.kafka_broker import TansuBroker, find_tansu
from bench.postgres import PostgresServer, find_binaries
from coalescer import Coalescer
from tests.helpers.servers import Cluster, ValkeyProcess, start_cluster, write_rules
from tests.helpers.threads import alive_threads, leftover_threads, running_test, track_starts

# A $COALESCER_NAMESPACE of the developer's shell would replace the namespace of every
# rules file these tests load (pyproject.toml keeps the plugin from setting it here).
os.environ.pop("COALESCER_NAMESPACE", None)

# Long scenarios (failovers, faults, floods, many shards, a broker, whole examples): marked
# slow, left out of the default run (`pytest -q`, under five minutes) and run apart with
# `pytest -m slow` (CI runs both).
SLOW_MODULES = frozenset({
    "tests/sources/test_kafka.py", "tests/test_model.py", "tests/web/test_connection_flood.py",
    "tests/worker/test_gray_failures.py", "tests/cli/test_supervisor.py",
    "tests/worker/test_shards.py", "tests/test_examples.py", "tests/worker/test_idle.py",
    "tests/worker/test_rolling.py", "tests/worker/test_reshard.py",
    "tests/worker/test_throttle.py", "tests/worker/test_health_leadership.py",
    "tests/store/test_replication.py", "tests/store/test_sentinel.py",
    "tests/test_example_orders.py", "tests/web/test_page_kafka.py",
    "tests/tracing/test_kafka_links.py", "tests/test_monitoring.py",
    "tests/worker/test_failover.py", "tests/worker/test_hung_handlers.py",
    "tests/cli/test_hints.py", "tests/sources/test_drain_kafka_worker.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        if item.path.relative_to(root).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)

RulesFactory = Callable[..., Path]


def pytest_configure(config: pytest.Config) -> None:
    track_starts()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    running_test(item.nodeid)


@pytest.fixture(scope="module", autouse=True)
def no_thread_outlives_its_module() -> Iterator[None]:
    """Every thread a test module starts is gone once the module ends: a thread left
    running is something not closed, and a non-daemon one would keep pytest from exiting."""
    before = alive_threads()
    yield
    left = leftover_threads(before)
    if left:
        pytest.fail(f"threads still running after the module's tests: {', '.join(left)}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def logging_levels_kept() -> Iterator[None]:
    """A command run in this process (``main([...])``, ``call_command``) sets the levels
    of the root and ``coalescer`` loggers as the command line does; the next test finds
    them as they were."""
    loggers = [logging.getLogger(), logging.getLogger("coalescer")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(dir=tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: ValkeyProcess) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest_asyncio.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(dir=tmp_path_factory.mktemp("own-valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = start_cluster(tmp_path_factory.mktemp("cluster"), n_masters=3)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    folder, why = find_binaries()
    if folder is None:
        pytest.skip(f"no PostgreSQL server: {why}")
    server = PostgresServer().start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


@pytest.fixture
def rules_file(tmp_path: Path) -> Iterator[RulesFactory]:
    """Each test's ``handlers`` module is its own: a cached one from an earlier test
    (same module name, another folder) is dropped before and after."""

    def make(yaml_text: str, handlers_py: str | None = None) -> Path:
        sys.modules.pop("handlers", None)
        return write_rules(tmp_path, yaml_text, handlers_py)

    yield make
    sys.modules.pop("handlers", None)


Start = Callable[..., Awaitable[Coalescer]]


@pytest_asyncio.fixture
async def start() -> AsyncIterator[Start]:
    """start(rules_path, **options) -> a started Coalescer, closed at teardown."""
    async with AsyncExitStack() as stack:
        async def make(path: Path, **options: Any) -> Coalescer:
            options.setdefault("grace", 2.0)
            c = Coalescer.from_yaml(path, **options)
            await stack.enter_async_context(c)
            return c

        yield make


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    binary, why = find_tansu()
    if binary is None:
        pytest.skip(f"no Kafka broker: {why}")
    with TansuBroker(binary, tmp_path_factory.mktemp("tansu")) as broker:
        yield broker
