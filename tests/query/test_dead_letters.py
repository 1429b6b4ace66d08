"""Dead letters: listing with totals and paging, retry and purge, by key, rule or all."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio

from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.query.dead_letters import format_dead_page
from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts
from tests.helpers.inspection import dead_count, fast_rules, node, write
from tests.helpers.servers import wait_until

BAD = [f"bad:{i}" for i in range(5)]


async def make_dead(c: Coalescer, keys: list[str], total: int) -> None:
    c.touch_many(keys)
    await wait_until(lambda: _dead_is(c, total), message=f"{total} dead letters")


async def _dead_is(c: Coalescer, n: int) -> bool:
    return await dead_count(c) == n


@pytest.mark.parametrize("shards", [1, 3])
async def test_list_pages_with_totals(tmp_path: Path, redis_url: str, namespace: str,
                                      shards: int) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, shards=shards))
    async with node(rules, redis_url) as c:
        await make_dead(c, BAD, 5)
        everything = await c.query.dead_letters(limit=100)
        first = await c.query.dead_letters(limit=2)
        second = await c.query.dead_letters(limit=2, offset=2)
        last = await c.query.dead_letters(limit=2, offset=4)
        beyond = await c.query.dead_letters(limit=2, offset=10)
        of_ok = await c.query.dead_letters(rule="ok")
    assert everything.total == 5 and sorted(d["key"] for d in everything.entries) == BAD
    since = [d["since_ms"] for d in everything.entries]
    assert since == sorted(since)
    assert [len(p.entries) for p in (first, second, last, beyond)] == [2, 2, 1, 0]
    assert [d["key"] for p in (first, second, last) for d in p.entries] == [
        d["key"] for d in everything.entries]
    assert {d["error"] for d in everything.entries} == {
        f"RuntimeError: no such user: {k}" for k in BAD}
    assert {d["attempts"] for d in everything.entries} == {1}
    assert of_ok.total == 0 and of_ok.entries == []
    text = format_dead_page(first)
    assert text.startswith("showing 2 of 5 dead letters (1-2, oldest first)")
    assert "next page: --offset 2 --limit 2" in text


async def test_default_settings_dead_letter_after_five_attempts(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, attempts=5, backoff="1ms"))
    async with node(rules, redis_url) as c:
        await make_dead(c, ["bad:x"], 1)
        page = await c.query.dead_letters(["bad:x", "ok:1"])
    assert [(d["key"], d["attempts"]) for d in page.entries] == [("bad:x", 5)]
    assert page.not_dead == ["ok:1"]


async def test_retry_and_purge_only_dead_keys(tmp_path: Path, redis_url: str, namespace: str,
                                              redis_client: redis.asyncio.Redis) -> None:
    rules, module = write(tmp_path, namespace, fast_rules(namespace, shards=2))
    async with node(rules, redis_url) as c:
        await make_dead(c, BAD, 5)
        purged = await c.query.purge_dead(["bad:0", "bad:1", "ok:1"])
        assert (purged.done, purged.not_dead) == (2, ["ok:1"])
        again = await c.query.purge_dead(["bad:0"])
        assert (again.done, again.not_dead) == (0, ["bad:0"])
        calls = len(module.calls)
        retried = await c.query.retry_dead(["bad:2", "bad:0"])
        assert (retried.done, retried.not_dead) == (1, ["bad:0"])
        await wait_until(lambda: len(module.calls) > calls and _dead_is(c, 3))
        assert (await c.query.purge_dead(rule="bad")).done == 3
        assert await dead_count(c) == 0
    space = KeySpace(namespace, 2)
    for sk in space.all_shards():
        assert await redis_client.hlen(sk.meta) == 0  # no state is left behind


async def test_purge_leaves_a_key_touched_since_it_died(
        redis_client: redis.asyncio.Redis, namespace: str) -> None:
    shard, scripts = ShardKeys(namespace, 0), Scripts(redis_client)
    await redis_client.hset(shard.meta, mapping={"k:1": "D|1|2|3|boom", "k:2": "D|1|2|3|boom"})
    await redis_client.zadd(shard.dead("r"), {"k:1": 5, "k:2": 5})
    await scripts.upsert(shard, [UpsertGroup("r", 60_000, 60_000, ["k:2"])])  # a new burst
    assert await scripts.purge(shard, "r", ["k:1", "k:2", "k:3"]) == (1, ["k:2", "k:3"])
    assert await redis_client.hget(shard.meta, "k:1") is None
    assert states.kind(await redis_client.hget(shard.meta, "k:2")) == "pending"
    assert await redis_client.zcard(shard.dead("r")) == 0


# -- the CLI ----------------------------------------------------------------------------


def _dead_setup(rules: Path, redis_url: str, keys: list[str]) -> None:
    async def go() -> None:
        async with node(rules, redis_url) as c:
            await make_dead(c, keys, len(keys))
    asyncio.run(go())


def test_cli_dead(tmp_path: Path, redis_url: str, namespace: str,
                  capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, shards=3))
    _dead_setup(rules, redis_url, BAD)
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["dead", "list", *base, "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("showing 2 of 5 dead letters") and "--offset 2" in out
    assert main(["dead", "list", *base, "--json", "--offset", "4"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert (page["total"], len(page["dead_letters"]), page["offset"]) == (5, 1, 4)
    assert main(["dead", "list", *base, "bad:1", "ok:1"]) == 1
    captured = capsys.readouterr()
    assert "bad:1" in captured.out
    assert captured.err.splitlines() == [
        "coalescer dead list: 'ok:1' is not dead-lettered; nothing to show"]
    assert main(["dead", "retry", *base, "bad:1", "ok:1"]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == "re-queued 1 dead-lettered key"
    assert captured.err.splitlines() == [
        "coalescer dead retry: 'ok:1' is not dead-lettered; nothing to re-queue"]
    assert main(["dead", "purge", *base, "bad:2"]) == 0
    assert capsys.readouterr().out.strip() == "purged 1 dead-lettered key"
    assert main(["dead", "purge", *base, "bad:2"]) == 1
    assert "'bad:2' is not dead-lettered; nothing to purge" in capsys.readouterr().err
    assert main(["dead", "purge", *base, "--all"]) == 0
    assert capsys.readouterr().out.strip() == "purged 3 dead-lettered keys"
    assert main(["dead", "list", *base]) == 0
    assert capsys.readouterr().out.strip() == "no dead letters"


def test_cli_dead_errors(tmp_path: Path, redis_url: str, namespace: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    base = ["--rules", str(rules), "--redis", redis_url]
    assert main(["dead", "retry", *base, "--all", "bad:1"]) == 1
    assert capsys.readouterr().err.strip() == (
        "coalescer dead retry: name KEYs or pass --all / --rule, not both")
    assert main(["dead", "purge", *base]) == 1
    assert "name KEYs, or pass --all or --rule R" in capsys.readouterr().err
    assert main(["dead", "list", *base, "--rule", "nope"]) == 1
    assert "no rule named 'nope'" in capsys.readouterr().err
    assert main(["dead", "retry", *base, "nomatch:1"]) == 2
    assert "matches key 'nomatch:1'" in capsys.readouterr().err
    for bad in (["--limit", "0"], ["--offset", "-1"]):
        with pytest.raises(SystemExit) as caught:
            main(["dead", "list", *base, *bad])
        assert caught.value.code == 2


def test_cli_retry_exits_non_zero_for_keys_not_dead(
        tmp_path: Path, redis_url: str, namespace: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    _dead_setup(rules, redis_url, ["bad:1"])
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["retry", *base, "--all", "bad:1"]) == 1
    assert capsys.readouterr().err.strip() == (
        "coalescer retry: name KEYs or pass --all, not both")
    assert main(["retry", *base, "bad:1", "ok:2"]) == 1
    captured = capsys.readouterr()
    assert captured.out.strip() == "re-queued 1 dead-lettered key"
    assert captured.err.strip() == (
        "coalescer retry: 'ok:2' is not dead-lettered; nothing to re-queue")
    assert main(["retry", *base, "ok:2"]) == 1
