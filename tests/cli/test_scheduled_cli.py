"""Keys scheduled far ahead, in bulk: ``coalescer scheduled`` lists them with their
times, and ``coalescer cancel --rule R --scheduled-after T`` clears them a page at a
time, after which touches are taken again (1,200 keys scheduled ten years ahead had
filled ``limits.pending_keys`` for good); real processes on a real server."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coalescer import Coalescer
from coalescer.query.history import HistoryQuery
from coalescer.store.keys import KeySpace
from coalescer.web.api import HttpApi
from tests.cli.test_main import cli
from tests.conftest import RulesFactory, Start
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
shards: 4
limits: {{pending_keys: 1000, max_schedule_ahead: 3650d}}
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
rules:
  - name: remind
    match: "remind:{{id}}"
    items: {{max: 5}}
    handler: builtins:repr
  - name: other
    match: "other:{{id}}"
    handler: builtins:repr
"""


def counted(c: Coalescer) -> int | None:
    quota = c._run.quota
    return None if quota is None else quota.pending


async def _touch(http: aiohttp.ClientSession, api: HttpApi, keys: list[str]) -> int:
    async with http.post(f"http://127.0.0.1:{api.port}/touch", json={"keys": keys}) as r:
        return r.status


async def test_a_bulk_cancel_of_far_schedules_lets_touches_in_again(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str,
        redis_client: Any, *, tmp_path: Path) -> None:
    path = rules_file(RULES.format(ns=namespace))
    c = await start(path, redis_url=redis_url, worker=False)
    far = time.time() + 10 * 365 * 86_400 - 86_400
    c.touch_items([(f"remind:{n}", "row") for n in range(1200)], at=far)
    c.touch("remind:soon", delay="1h")  # scheduled, but before the cut: kept
    c.touch("remind:plain")  # not scheduled: kept
    c.touch("other:far", at=far)  # another rule: kept
    await c.flush()
    await wait_until(lambda: (counted(c) or 0) >= 1200, message="the pending keys counted")
    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http:
            assert await _touch(http, api, ["other:new"]) == 429  # every rule refused

            after = (datetime.now(UTC) + timedelta(days=365)).isoformat()
            args = ("--rules", str(path), "--redis", redis_url)
            dry = cli("cancel", "--rule", "remind", "--scheduled-after", after, "--dry-run",
                      *args, cwd=tmp_path)
            assert dry.returncode == 0, dry.stderr
            assert dry.stdout.strip() == (f"would cancel 1200 scheduled keys of rule remind "
                                          f"(due after {after})")
            done = cli("cancel", "--rule", "remind", "--scheduled-after", after, "-v",
                       *args, cwd=tmp_path)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == (f"cancelled 1200 scheduled keys of rule remind "
                                           f"(due after {after})")
            assert "operator action: cancel the keys of rule remind scheduled after" in \
                done.stderr and "1200 changed, by local user" in done.stderr

            await wait_until(lambda: (counted(c) or 0) < 1000, message="a new count")
            assert await _touch(http, api, ["other:new"]) == 202
    finally:
        await api.close()
    left: set[str] = set()
    for shard in KeySpace(namespace, 4).all_shards():
        left |= set(await redis_client.zrange(shard.due("remind"), 0, -1))
        assert not any(k.startswith(f"{shard.items_prefix}remind:")
                       for k in await redis_client.keys(f"{shard.items_prefix}*"))
    assert left == {"remind:soon", "remind:plain"}
    assert (await c.query.explain("other:far"))["state"] == "pending"
    [entry] = await c.query.history(HistoryQuery(key="remind:5"))
    assert (entry.outcome, entry.rule) == ("cancelled", "remind")


@pytest.mark.parametrize(("args", "says"), [
    (("--rule", "remind"), "give KEY... or --rule RULE --scheduled-after TIME"),
    (("remind:1", "--rule", "remind", "--scheduled-after", "2030-01-01T00:00:00Z"),
     "(not both)"),
    (("--rule", "nope", "--scheduled-after", "2030-01-01T00:00:00Z"), "no rule named 'nope'"),
    (("--rule", "remind", "--scheduled-after", "2030-01-01T00:00:00"),
     "--scheduled-after '2030-01-01T00:00:00': a naive datetime"),
])
def test_a_bad_bulk_cancel_says_why_and_cancels_nothing(
        tmp_path: Path, namespace: str, redis_url: str, args: tuple[str, ...],
        says: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace))
    done = cli("cancel", *args, "--rules", str(path), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode in (1, 2)
    assert says in done.stderr


async def test_scheduled_lists_the_scheduled_keys_soonest_first(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str,
        tmp_path: Path) -> None:
    path = rules_file(RULES.format(ns=namespace))
    c = await start(path, redis_url=redis_url, worker=False)
    base = int(time.time()) + 86_400
    for n in range(30):
        c.touch(f"remind:{n}", at=base + n * 3600)
    c.touch("remind:plain")  # not scheduled: not listed
    c.touch("other:x", at=base + 1800)
    await c.flush()
    args = ("--rules", str(path), "--redis", redis_url)
    done = cli("scheduled", "-n", "3", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[-2:] for line in lines] == [
        ["remind", "remind:0"], ["other", "other:x"], ["remind", "remind:1"]]
    first = datetime.fromtimestamp(base, UTC).isoformat(timespec="seconds")
    assert lines[0].startswith(f"{first}  in ")
    done = cli("scheduled", "--rule", "remind", "-n", "100", "--json", *args, cwd=tmp_path)
    found = json.loads(done.stdout)
    assert [k["key"] for k in found["keys"]] == [f"remind:{n}" for n in range(30)]
    assert found["keys"][29]["due_ms"] == (base + 29 * 3600) * 1000
    assert found["capped"] is False
    done = cli("scheduled", "--rule", "nope", *args, cwd=tmp_path)
    assert done.returncode == 1 and "no rule named 'nope'" in done.stderr
    page = await c.query.scheduled_keys("other")
    assert [k["key"] for k in page["keys"]] == ["other:x"]


async def test_delete_rule_scheduled_cancels_in_bulk_over_http(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer.common.audit_log")
    c = await start(rules_file(RULES.format(ns=namespace)), redis_url=redis_url,
                    worker=False)
    far = time.time() + 300 * 86_400
    c.touch_many([f"remind:{n}" for n in range(50)], at=far)
    c.touch("remind:soon", delay="1h")
    await c.flush()
    api = HttpApi(c, port=0)
    await api.start()
    base = f"http://127.0.0.1:{api.port}/rules"
    after = str(int(time.time()) + 86_400)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{base}/remind/scheduled",
                                   params={"after": after, "dry_run": "1"}) as r:
                assert (r.status, await r.json()) == (200, {
                    "rule": "remind", "after": after, "dry_run": True, "cancelled": 50})
            async with http.delete(f"{base}/remind/scheduled", params={"after": after}) as r:
                assert (r.status, (await r.json())["cancelled"]) == (200, 50)
            async with http.delete(f"{base}/remind/scheduled",
                                   params={"after": "1969-01-01T00:00:00Z"}) as r:
                body = await r.json()
                assert (r.status, body["field"]) == (400, "after")
                assert "before the epoch" in body["error"]
            async with http.delete(f"{base}/remind/scheduled") as r:
                assert (r.status, (await r.json())["field"]) == (400, "after")
            async with http.delete(f"{base}/nope/scheduled", params={"after": after}) as r:
                assert r.status == 404
    finally:
        await api.close()
    page = await c.query.scheduled_keys("remind")
    assert [k["key"] for k in page["keys"]] == ["remind:soon"]
    lines = [r.getMessage() for r in caplog.records if "operator action" in r.getMessage()]
    assert len(lines) == 1 and "50 changed, by anonymous from 127.0.0.1" in lines[0]
