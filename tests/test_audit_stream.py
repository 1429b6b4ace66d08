"""Every operator action lands in the namespace's audit log (a capped Redis stream):
who, what, when and how many, from the commands (the local user) and the HTTP API (the
token); a write that fails never fails the action, and is logged once and counted."""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from coalescer import Coalescer, Config
from coalescer.cli.main import main
from coalescer.common import audit_log
from coalescer.common.audit_log import operator_action
from coalescer.store.audit_stream import AuditStream, read_audit
from coalescer.store.keys import audit_log as audit_key
from tests.cli.test_main import write_rules
from tests.web.test_api import TOKEN, NodeFactory, make_node  # noqa: F401 (a fixture)

LOCAL = f"local user {getpass.getuser()} (uid {os.getuid()})"


def entries(redis_url: str, namespace: str) -> list[tuple[str, str, str, str]]:
    """(action, target, count, who) of each entry, oldest first."""
    with sync_redis.Redis.from_url(redis_url, decode_responses=True) as client:
        found = client.xrange(audit_key(namespace))
    return [(f["action"], f["target"], f["count"], f["who"]) for _, f in found]


def test_every_cli_action_is_written_with_the_local_user(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    rules = write_rules(tmp_path, namespace, window="1h", max_wait="2h")
    common = ["--rules", str(rules), "--redis", redis_url]
    assert main(["touch", "item:1", "item:2", *common]) == 0
    assert main(["touch", "item:5", "--delay", "2h", *common]) == 0
    assert main(["pause", "item", *common]) == 0
    assert main(["resume", "item", *common]) == 0
    assert main(["run-now", "item:1", *common]) == 0
    assert main(["cancel", "item:2", *common]) == 0
    assert main(["retry", "--all", *common]) == 0
    assert main(["dead", "purge", "--rule", "item", *common]) == 0
    assert main(["cancel", "--rule", "item", "--scheduled-after", "2000-01-01T00:00:00Z",
                 *common]) == 0
    written = entries(redis_url, namespace)
    assert [(a, n, w) for a, _, n, w in written] == [
        ("pause", "1", LOCAL), ("resume", "1", LOCAL), ("run-now", "1", LOCAL),
        ("cancel", "1", LOCAL), ("retry", "0", LOCAL), ("dead purge", "0", LOCAL),
        ("cancel", "1", LOCAL)]
    assert written[3][1] == "1 key ('item:2')"
    assert written[6][1].startswith("the keys of rule item scheduled after 2000-01-01")


async def test_every_http_action_is_written_with_the_token(
        make_node: NodeFactory, redis_url: str, namespace: str) -> None:  # noqa: F811
    node = await make_node(worker=False, token=TOKEN)
    assert (await node.touch({"keys": ["stats:user:1"]}, token=TOKEN))[0] == 202
    await node.c.flush()
    for method, path in [("POST", "/rules/user-stats/pause"),
                         ("POST", "/keys/stats:user:1/run"),
                         ("DELETE", "/keys/stats:user:1"),
                         ("POST", "/dead/retry")]:
        body = {"keys": ["stats:user:9"]} if path == "/dead/retry" else {}
        status, answer, _ = await node.request(method, path, json=body, token=TOKEN)
        assert status == 200, answer
    await node.c.audit.settle()
    found = await read_audit(node.c.redis, namespace, limit=10)
    assert [(r.action, r.count, r.who) for r in found] == [
        ("retry", 0, "token"), ("cancel", 1, "token"), ("run-now", 1, "token"),
        ("pause", 1, "token")]
    assert found[0].at_ms >= found[-1].at_ms > 0
    older = await read_audit(node.c.redis, namespace, limit=2, before=found[1].id)
    assert [r.action for r in older] == ["run-now", "pause"]


async def test_a_failed_write_never_fails_the_action_and_is_logged_once_and_counted(
        redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    client: Any = sync_redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0",
                                                    socket_connect_timeout=0.2)
    sink = AuditStream(client, namespace)
    before = audit_log.write_failures()
    caplog.set_level(logging.WARNING, logger="coalescer.common.audit_log")
    for _ in range(3):
        operator_action("pause", "rule r", 1, "someone", sink=sink)  # returns at once
    await sink.settle()
    await client.aclose()
    assert audit_log.write_failures() == before + 3
    lines = [r.getMessage() for r in caplog.records
             if "could not be written to the audit log" in r.getMessage()]
    assert len(lines) == 1 and "the action itself was done" in lines[0]

    class Broken:
        def record(self, entry: Any) -> None:
            raise RuntimeError("no loop")

    operator_action("pause", "rule r", 1, "someone", sink=Broken())  # no raise
    assert audit_log.write_failures() == before + 4
    closed = Coalescer(Config.from_string(
        "rules:\n  - {name: r, match: 'r:{id}', handler: builtins:repr}\n"),
        redis_url=redis_url, worker=False)
    operator_action("pause", "rule r", 1, "someone", sink=closed.audit)  # not connected
    assert audit_log.write_failures() == before + 5


async def test_the_stream_is_capped(redis_url: str, namespace: str) -> None:
    client: Any = sync_redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    sink = AuditStream(client, namespace, maxlen=10)
    for n in range(300):
        operator_action("pause", f"rule r{n}", 1, "me", sink=sink)
    await sink.settle()
    assert await client.xlen(audit_key(namespace)) < 300
    newest = await read_audit(client, namespace, limit=1)
    assert newest[0].target == "rule r299"
    with pytest.raises(ValueError, match="the number of entries must be 1 to 1000"):
        await read_audit(client, namespace, limit=0)
    await client.aclose()
    await asyncio.sleep(0)
