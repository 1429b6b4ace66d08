"""A maxmemory-policy that may evict coalescer's keys: refused at start, reported when
it changes under a running node (log, status, /healthz, metric)."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from coalescer import Coalescer, SyncCoalescer
from coalescer.errors import EvictionPolicyError
from coalescer.query.status import format_status
from coalescer.store import eviction
from coalescer.web.api import HttpApi
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.servers import Cluster, ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: builtins:print
"""
FIX = "CONFIG SET maxmemory-policy noeviction"


@pytest.fixture
def rules(rules_file: Callable[..., Path], namespace: str) -> Path:
    return rules_file(RULES.format(ns=namespace))


@pytest.mark.parametrize("worker", [True, False])
async def test_start_is_refused_on_an_allkeys_policy(
        rules: Path, own_server: ValkeyProcess, worker: bool) -> None:
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", "allkeys-lru")
    c = Coalescer.from_yaml(rules, redis_url=own_server.url, worker=worker)
    with pytest.raises(EvictionPolicyError, match="maxmemory-policy is allkeys-lru") as info:
        await c.start()
    assert FIX in str(info.value)
    with own_server.client() as admin:  # its connections were closed
        clients = admin.client_list()
    assert len(clients) == 1


def test_a_sync_writer_is_refused_too(rules: Path, own_server: ValkeyProcess) -> None:
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", "allkeys-random")
    writer = SyncCoalescer.from_yaml(rules, redis_url=own_server.url)
    with pytest.raises(EvictionPolicyError, match=f"allkeys-random.*{FIX}"):
        writer.start()


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
async def test_policies_that_spare_keys_without_a_ttl_are_accepted(
        rules: Path, own_server: ValkeyProcess, policy: str) -> None:
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", policy)
    async with Coalescer.from_yaml(rules, redis_url=own_server.url, worker=False) as c:
        c.touch("stats:1")
        await c.flush()
        assert c.health_problems() == []


async def test_an_acl_user_without_config_is_checked_through_info(
        rules: Path, own_server: ValkeyProcess) -> None:
    with own_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "+@all", "-config",
                              "~*", "&*")
        admin.config_set("maxmemory-policy", "allkeys-lfu")
    url = own_server.url.replace("redis://", "redis://app:pw@")
    with pytest.raises(EvictionPolicyError, match="allkeys-lfu"):
        await Coalescer.from_yaml(rules, redis_url=url, worker=False).start()


async def test_a_policy_nobody_can_read_is_warned_about_and_the_start_goes_on(
        rules: Path, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture) -> None:
    with own_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "+@all", "-config",
                              "-info", "+info|cluster", "~*", "&*")
    url = own_server.url.replace("redis://", "redis://app:pw@")
    async with Coalescer.from_yaml(rules, redis_url=url, worker=False) as c:
        c.touch("stats:1")
        await c.flush()
    [warning] = [r for r in caplog.records if "could not read maxmemory-policy" in r.message]
    assert warning.levelno == logging.WARNING
    assert "never allkeys-*" in warning.message


async def test_a_change_under_a_running_node_is_reported(
        rules: Path, own_server: ValkeyProcess, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eviction, "CHECK_EVERY", 0.05)
    async with Coalescer.from_yaml(rules, redis_url=own_server.url, node_id="n1") as c, \
            HttpApi(c, port=0) as api, aiohttp.ClientSession() as http:
        assert evicting(c) == 0
        with own_server.client() as admin:
            admin.config_set("maxmemory-policy", "allkeys-lru")
        await wait_until(lambda: evicting(c) == 1, message="the change to be noticed")

        [logged] = [r for r in caplog.records if r.levelno == logging.ERROR
                    and "maxmemory-policy is allkeys-lru" in r.message]
        assert FIX in logged.message
        async with http.get(f"http://127.0.0.1:{api.port}/healthz") as response:
            body: dict[str, Any] = await response.json()
            assert response.status == 503
        assert "maxmemory-policy is allkeys-lru" in body["error"]
        status = await c.query.status()
        assert status["memory"]["evicting"] is True
        assert list(status["memory"]["maxmemory_policy"].values()) == ["allkeys-lru"]
        text = format_status(status, int(time.time() * 1000))
        assert "WARNING: Redis maxmemory-policy is allkeys-lru" in text

        with own_server.client() as admin:
            admin.config_set("maxmemory-policy", "noeviction")
        await wait_until(lambda: evicting(c) == 0, message="the fix to be noticed")
        async with http.get(f"http://127.0.0.1:{api.port}/healthz") as response:
            assert response.status == 200
        assert (await c.query.status())["memory"]["evicting"] is False


def evicting(c: Coalescer) -> float | None:
    return c.metrics.registry.get_sample_value("coalescer_redis_evicting_policy")


async def test_every_master_of_a_cluster_is_checked(rules: Path, cluster: Cluster) -> None:
    last = redis.Redis.from_url(cluster.urls[-1], decode_responses=True)
    try:
        last.config_set("maxmemory-policy", "allkeys-lru")
        c = Coalescer.from_yaml(rules, redis_url=cluster.urls[0], worker=False)
        with pytest.raises(EvictionPolicyError, match=f"allkeys-lru on 127.0.0.1:"
                                                      f"{cluster.ports[-1]}"):
            await c.start()
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        last.close()
    async with Coalescer.from_yaml(rules, redis_url=cluster.urls[0], worker=False) as c:
        status = await c.query.status()
        policies = status["memory"]["maxmemory_policy"]
        assert sorted(policies) == sorted(f"127.0.0.1:{port}" for port in cluster.ports)
        assert set(policies.values()) == {"noeviction"}


def test_coalescer_status_shows_the_policy_and_touch_is_refused(
        rules: Path, own_server: ValkeyProcess) -> None:
    with own_server.client() as admin:
        admin.config_set("maxmemory-policy", "allkeys-lru")
    base = ("--rules", str(rules), "--redis", own_server.url)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*coalescer_cmd(), *args, *base], capture_output=True,
                              text=True, env=clean_env(), timeout=60, check=False)

    status = run("status")
    assert status.returncode == 0, status.stderr
    assert "WARNING: Redis maxmemory-policy is allkeys-lru" in status.stdout
    assert FIX in status.stdout
    memory = json.loads(run("status", "--json").stdout)["memory"]
    assert memory["evicting"] is True
    assert list(memory["maxmemory_policy"].values()) == ["allkeys-lru"]
    touch = run("touch", "stats:1")
    assert touch.returncode != 0
    assert "maxmemory-policy is allkeys-lru" in touch.stderr and FIX in touch.stderr
