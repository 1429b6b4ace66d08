"""Redis Sentinel: a real primary, two replicas and three sentinels, all started from the
bundled binary; coalescer on a ``redis+sentinel://`` URL follows their failover."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from coalescer.errors import CoalescerError
from coalescer.store.sentinel import parse_sentinel_url
from tests.conftest import Start
from tests.helpers.e2e import clean_env, coalescer_cmd, recorder_rules
from tests.helpers.servers import (
    SentinelProcess,
    ValkeyProcess,
    replica_of,
    sentinel_url,
    start_sentinels,
    wait_until,
)

SERVICE = "orders"
HOT = ("item:hot-1", "item:hot-2", "item:hot-3")  # touched in every batch
RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 4s
durability: {{replicas: 1, timeout: 1s}}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 5s
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


@dataclass
class Group:
    primary: ValkeyProcess
    replicas: list[ValkeyProcess]
    sentinels: list[SentinelProcess]

    @property
    def url(self) -> str:
        return sentinel_url(self.sentinels, SERVICE)

    def master_port(self) -> int:
        client = self.sentinels[0].client()
        try:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        finally:
            client.close()
        return int(port)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    servers: list[ValkeyProcess] = []
    try:
        servers.append(primary := ValkeyProcess(dir=tmp_path / "primary"))
        replicas = [replica_of(primary, tmp_path / f"replica{i}") for i in range(2)]
        servers += replicas
        sentinels = start_sentinels(primary, tmp_path / "sentinels", service=SERVICE)
        servers += sentinels
        yield Group(primary, replicas, sentinels)
    finally:
        for server in reversed(servers):
            server.stop()


async def test_a_writer_and_node_on_a_sentinel_url_lose_no_acknowledged_touch_in_a_failover(
        tmp_path: Path, namespace: str, group: Group, start: Start) -> None:
    path, rec = recorder_rules(tmp_path, f"rec_{namespace}", RULES.format(ns=namespace))
    c = await start(path, redis_url=group.url, node_id="n1")
    acknowledged: list[str] = []
    failed_flushes = after_kill = batch = 0
    before_kill: dict[str, int] = {}
    while after_kill < 5:  # touches until five flushes went through after the failover
        keys = [f"item:{batch}-{j}" for j in range(20)]  # each touched once
        batch += 1
        for key in [*keys, *HOT]:
            c.touch(key)
        try:
            await c.flush()
        except (CoalescerError, RedisError):
            failed_flushes += 1  # kept buffered: acknowledged by a later flush
            await asyncio.sleep(0.1)
            continue
        acknowledged += keys
        if group.primary.running:
            if batch >= 10 and all(rec.of(key) for key in HOT):  # refreshed before it
                before_kill = {key: len(rec.of(key)) for key in HOT}
                group.primary.kill()  # SIGKILL under the stream of touches
        else:
            after_kill += 1
        await asyncio.sleep(0.02)

    assert group.master_port() != group.primary.port  # the sentinels promoted a replica
    assert failed_flushes > 0  # the stream did meet the failover
    await wait_until(lambda: set(acknowledged) <= {claim.key for claim in rec.calls},
                     timeout=20.0, message="every acknowledged key refreshed")
    await wait_until(lambda: all(len(rec.of(key)) > before_kill[key] for key in HOT),
                     timeout=20.0, message="every hot key refreshed after the failover too")
    for key in HOT:  # refreshed on both sides of the failover: no token ever repeats
        tokens = [claim.token for claim in rec.of(key)]
        assert len(tokens) > 1 and tokens == sorted(set(tokens)), (key, tokens)

    # the command line reads the same deployment through the sentinels, after the failover
    proc = await asyncio.create_subprocess_exec(
        *coalescer_cmd(), "status", "--rules", str(path), "--redis", group.url, cwd=tmp_path,
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "n1" in out.decode()


def test_a_sentinel_url_names_its_sentinels_service_database_and_password() -> None:
    parsed = parse_sentinel_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2/orders/2")
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert (parsed.service, parsed.db, parsed.password) == ("orders", 2, "s3cret")
    assert "s3cret" not in repr(parsed)


def test_the_command_line_refuses_a_bad_sentinel_url_without_showing_its_password(
        tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text('rules:\n  - {name: a, match: "a:*", handler: json:dumps}\n')
    done = subprocess.run(
        [*coalescer_cmd(), "status", "--rules", str(rules), "--redis",
         "redis+sentinel://:s3cret@127.0.0.1:26379"], cwd=tmp_path, env=clean_env(),
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr == (
        "coalescer status: --redis: 'redis+sentinel://:***@127.0.0.1:26379' is not a usable "
        "Redis Sentinel URL: the URL names no service: write "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]\n")


@pytest.mark.parametrize(("url", "fragment"), [
    ("redis+sentinel://10.0.0.1:26379", "names no service"),
    ("redis+sentinel://10.0.0.1:port/orders", "not a port number"),
    ("redis+sentinel://:26379/orders", "missing its host"),
    ("redis+sentinel://10.0.0.1/orders/zero", "'zero' is not a number"),
])
def test_a_bad_sentinel_url_is_refused_saying_what_is_wrong(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_sentinel_url(url)
