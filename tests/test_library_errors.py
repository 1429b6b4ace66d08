"""The library explains a wrong Redis URL or server as the command line does: one of
coalescer's own errors, saying what to check, raised from redis-py's original."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis.exceptions

from coalescer import Coalescer, SyncCoalescer
from coalescer.cli.errors import redis_failure
from coalescer.errors import (
    ConfigError,
    RedisAuthenticationError,
    RedisConnectError,
    RedisUnreachableError,
    RedisUrlError,
    UnwrittenTouchesError,
)
from tests.helpers.servers import ValkeyProcess, free_port

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 10s
    handler: builtins:print
"""
PASSWORD = "s3cret-Pa55word"
REFUSED = "connection refused (is a Redis server listening there?)"


@pytest.fixture
def rules(rules_file: Callable[..., Path], namespace: str) -> Path:
    return rules_file(RULES.format(ns=namespace))


@pytest.fixture
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(dir=tmp_path_factory.mktemp("locked"), password=PASSWORD)
    yield server
    server.stop()


def test_a_redis_address_without_a_scheme_says_what_to_write(rules: Path) -> None:
    for make in (Coalescer.from_yaml, SyncCoalescer.from_yaml):
        with pytest.raises(RedisUrlError) as info:
            make(rules, redis_url="localhost:6379", worker=False)
        assert str(info.value) == ("redis_url: 'localhost:6379' is not a Redis URL; "
                                   "write redis://localhost:6379/0")
        assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
        assert isinstance(info.value.__cause__, ValueError)  # redis-py's own words
        assert "must specify one of the following schemes" in str(info.value.__cause__)


async def test_an_unusable_url_in_the_environment_is_named_at_start(
        rules: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COALESCER_REDIS_URL", "redis://:pw@127.0.0.1:port/0")
    c = Coalescer.from_yaml(rules, worker=False)
    with pytest.raises(RedisUrlError) as info:
        await c.start()
    assert str(info.value).startswith(
        "$COALESCER_REDIS_URL: 'redis://:***@127.0.0.1:port/0' is not a usable Redis URL")
    assert info.value.__cause__ is None  # redis-py's words might quote the password


async def test_nothing_listening_at_start_is_one_line_naming_the_server(rules: Path) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisConnectError) as info:
        async with Coalescer.from_yaml(rules, redis_url=url, worker=True):
            pass
    shown = url.replace("hunter2", "***")
    assert str(info.value) == f"could not connect to {shown}: {REFUSED}"
    assert isinstance(info.value, RedisUnreachableError)
    assert isinstance(info.value, redis.exceptions.ConnectionError)  # what it was before
    assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)

    sync = SyncCoalescer.from_yaml(rules, redis_url=url)
    with pytest.raises(RedisConnectError, match="could not connect to"):
        sync.start()


async def test_a_password_refused_or_missing_says_which(
        rules: Path, locked_server: ValkeyProcess) -> None:
    port = locked_server.port
    wrong = f"redis://:not-{PASSWORD}@127.0.0.1:{port}/0"
    with pytest.raises(RedisAuthenticationError) as info:
        async with Coalescer.from_yaml(rules, redis_url=wrong, worker=False):
            pass
    assert str(info.value) == (f"redis://:***@127.0.0.1:{port}/0: the server refused the "
                               "password (invalid username-password pair or user is "
                               "disabled.)")
    assert isinstance(info.value.__cause__, redis.exceptions.AuthenticationError)

    with pytest.raises(RedisAuthenticationError) as info:
        async with Coalescer.from_yaml(rules, redis_url=f"redis://127.0.0.1:{port}/0",
                                       worker=False):
            pass
    assert str(info.value) == (f"redis://127.0.0.1:{port}/0: the server requires a password; "
                               "give it in the URL: redis://:PASSWORD@HOST:PORT/0")


async def test_reads_cancel_and_flush_on_a_stopped_server_name_it(
        rules: Path, own_server: ValkeyProcess) -> None:
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False)
    await c.start()
    own_server.stop()
    with pytest.raises(RedisConnectError) as info:
        await c.query.status()
    assert str(info.value) == f"could not connect to {own_server.url}: {REFUSED}"
    with pytest.raises(RedisConnectError, match=f"could not connect to {own_server.url}"):
        await c.query.explain("stats:1")
    with pytest.raises(RedisConnectError, match=f"could not connect to {own_server.url}"):
        await c.cancel("stats:1")
    c.touch("stats:2")
    with pytest.raises(RedisConnectError) as flushed:
        await c.flush()
    assert str(flushed.value) == f"could not connect to {own_server.url}: {REFUSED}"
    assert isinstance(flushed.value, RedisUnreachableError)  # what flush() raised before
    assert redis_failure(own_server.url, flushed.value) == (  # the CLI's line, not doubled
        f"could not connect to {own_server.url} (from --redis): {REFUSED}")
    with pytest.raises(UnwrittenTouchesError):
        await c.close(flush_timeout=0.1)


# -- a coalescer never closed ---------------------------------------------------------------


def test_a_started_coalescer_never_closed_warns_of_its_lost_touches(
        rules: Path, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    async def forget_to_close() -> None:
        c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False)
        await c.start()
        own_server.stop()  # the touches cannot be written: they wait in the buffer
        c.touch_many(["stats:1", "stats:2", "stats:3"])

    with pytest.warns(ResourceWarning, match="was never closed: 3 touched keys not written "
                      "to Redis are lost; use 'async with Coalescer"):
        asyncio.run(forget_to_close())
        gc.collect()
    lines = [r for r in caplog.records if "was never closed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING"


async def test_a_closed_or_never_started_coalescer_does_not_warn(
        rules: Path, redis_url: str, recwarn: pytest.WarningsRecorder) -> None:
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        c.touch("stats:1")
    Coalescer.from_yaml(rules, redis_url=redis_url, worker=False)  # never started
    del c
    gc.collect()
    assert not [w for w in recwarn if "never closed" in str(w.message)]
