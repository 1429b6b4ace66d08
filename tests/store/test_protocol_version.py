"""The touch protocol's version kept per namespace: written by the first writer or
node, read by every one, and an unknown major version refused at start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from coalescer import Coalescer, ProtocolVersionError, SyncCoalescer
from coalescer.store import keys
from coalescer.store.protocol_version import VERSION
from tests.helpers.servers import ValkeyProcess

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:print
"""


@pytest.fixture
def rules(rules_file: Callable[..., Path], namespace: str) -> Path:
    return rules_file(RULES.format(ns=namespace))


@pytest.mark.parametrize("worker", [True, False])
async def test_the_first_start_writes_the_version_and_touches_work(
        rules: Path, redis_url: str, namespace: str, worker: bool) -> None:
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=worker) as c:
        c.touch("stats:1")
        await c.flush()
    with redis.Redis.from_url(redis_url, decode_responses=True) as admin:
        assert admin.get(keys.protocol_version(namespace)) == VERSION == "1.0"


async def test_a_later_minor_version_of_the_same_major_is_accepted_and_kept(
        rules: Path, redis_url: str, namespace: str) -> None:
    key = keys.protocol_version(namespace)
    with redis.Redis.from_url(redis_url, decode_responses=True) as admin:
        admin.set(key, "1.7")
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        c.touch("stats:1")
        await c.flush()
    with redis.Redis.from_url(redis_url, decode_responses=True) as admin:
        assert admin.get(key) == "1.7"


@pytest.mark.parametrize(("stored", "said"), [("2.0", "version 2.0"),
                                              ("0.9", "version 0.9"),
                                              ("v1", "an unreadable version 'v1'")])
@pytest.mark.parametrize("worker", [True, False])
async def test_another_major_version_is_refused_naming_both(
        rules: Path, own_server: ValkeyProcess, namespace: str, *, worker: bool,
        stored: str, said: str) -> None:
    key = keys.protocol_version(namespace)
    with own_server.client() as admin:
        admin.set(key, stored)
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=worker)
    with pytest.raises(ProtocolVersionError) as info:
        await c.start()
    message = str(info.value)
    assert f"touch protocol {said}" in message
    assert "speaks version 1.0" in message and key in message
    assert (info.value.stored, info.value.spoken) == (stored, "1.0")
    with own_server.client() as admin:
        assert admin.get(key) == stored, "the stored version is left alone"
        assert len(admin.client_list()) == 1, "its connections were closed"
        assert admin.keys(f"{namespace}:*") == [key], "nothing else was written"


def test_a_sync_writer_is_refused_too(rules: Path, redis_url: str, namespace: str) -> None:
    with redis.Redis.from_url(redis_url, decode_responses=True) as admin:
        admin.set(keys.protocol_version(namespace), "3.1")
    writer = SyncCoalescer.from_yaml(rules, redis_url=redis_url)
    with pytest.raises(ProtocolVersionError, match=r"version 3\.1 .*speaks version 1\.0"):
        writer.start()
