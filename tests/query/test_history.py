"""The refresh history: a capped stream per shard, `coalescer history`, status failure rates."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio

from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.config.rules import Config
from coalescer.errors import ConfigError
from coalescer.query.history import HistoryQuery, format_history
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.script_types import Failure, History, UpsertGroup
from coalescer.store.scripts import Scripts
from tests.helpers.e2e import server_ms
from tests.helpers.inspection import DEFAULTS, fast_rules, node, write
from tests.helpers.servers import wait_until


async def recorded(c: Coalescer, n: int, **query: object) -> list:  # type: ignore[type-arg]
    async def enough() -> list:  # type: ignore[type-arg]
        found = await c.query.history(HistoryQuery(limit=1000, **query))  # type: ignore[arg-type]
        return found if len(found) >= n else []
    return list(await wait_until(enough, message=f"{n} refreshes in the history"))


# -- recording ------------------------------------------------------------------------


async def test_default_rules_record_every_refresh(tmp_path: Path, redis_url: str,
                                                  namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, DEFAULTS.format(ns=namespace))
    assert Config.from_yaml(rules).history == 1000
    async with node(rules, redis_url) as c:
        before = await server_ms(c.redis)
        for i in range(3):
            c.touch(f"item:{i}")
        await c.flush()
        found = await recorded(c, 3)
        after = await server_ms(c.redis)
    assert sorted(r.key for r in found) == ["item:0", "item:1", "item:2"]
    for r in found:
        assert (r.rule, r.node, r.outcome, r.attempt, r.error) == ("item", "node-a", "success",
                                                                   1, "")
        assert before + 2000 <= r.start_ms <= after  # default window: 2s after the touch
        assert 0 <= r.duration_ms <= after - r.start_ms
        assert r.token > 0


async def test_failures_and_timeouts_are_recorded_with_their_error(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, attempts=2))
    async with node(rules, redis_url) as c:
        c.touch_many(["bad:1", "slow:1", "ok:1"])
        found = await recorded(c, 5)
    by_key = {k: [r for r in found if r.key == k] for k in ("bad:1", "slow:1", "ok:1")}
    assert [(r.outcome, r.attempt) for r in by_key["bad:1"]] == [("failure", 2), ("failure", 1)]
    assert by_key["bad:1"][0].error == "RuntimeError: no such user: bad:1"
    assert [(r.outcome, r.attempt) for r in by_key["slow:1"]] == [("timeout", 2), ("timeout", 1)]
    assert "ran past its timeout of 0.2s" in by_key["slow:1"][0].error
    assert by_key["slow:1"][0].duration_ms >= 200
    assert [r.outcome for r in by_key["ok:1"]] == ["success"]


async def test_a_stale_result_is_recorded_as_lost(redis_client: redis.asyncio.Redis,
                                                  namespace: str) -> None:
    shard, scripts = ShardKeys(namespace, 0), Scripts(redis_client)
    await scripts.upsert(shard, [UpsertGroup("r", 0, 1000, ["k:1", "k:2"])])
    history = History("node-x", 100)
    assert await scripts.ack(shard, [("r", [("k:1", 99, 1_000, 5)])], history) == ["k:1"]
    stale = await scripts.fail(shard, [("r", 3, [Failure("k:2", 98, 0, "Boom", "failure", 7, 8)])],
                               history)
    assert stale == (0, [], ["k:2"])
    entries = await redis_client.xrange(shard.history)
    assert [(f["key"], f["outcome"], f["token"], f["node"]) for _, f in entries] == [
        ("k:1", "lost", "99", "node-x"), ("k:2", "lost", "98", "node-x")]
    assert entries[1][1]["error"] == "Boom"


async def test_history_is_capped(tmp_path: Path, redis_url: str, namespace: str,
                                 redis_client: redis.asyncio.Redis) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, history=10, concurrency=500))
    async with node(rules, redis_url) as c:
        c.touch_many([f"ok:{i}" for i in range(400)])
        await wait_until(lambda: _xlen_total(redis_client, namespace, 1, 0),
                         message="refreshes recorded")
        await wait_until(lambda: _settled(c), message="every refresh done")
    # Approximate trimming keeps whole blocks (100 entries): far fewer than 400.
    assert 10 <= await redis_client.xlen(ShardKeys(namespace, 0).history) <= 110


async def test_history_zero_records_nothing(tmp_path: Path, redis_url: str, namespace: str,
                                            redis_client: redis.asyncio.Redis) -> None:
    rules, module = write(tmp_path, namespace, fast_rules(namespace, history=0))
    async with node(rules, redis_url) as c:
        c.touch_many(["ok:1", "bad:1"])
        await wait_until(lambda: len(module.calls) >= 2 and _settled(c, dead=1))
        assert await c.query.history() == []
    assert await redis_client.exists(ShardKeys(namespace, 0).history) == 0


async def _settled(c: Coalescer, dead: int = 0) -> bool:
    status = await c.query.status()
    rules = status["rules"].values()
    return (sum(r["pending"] + r["in_flight"] for r in rules) == 0
            and sum(r["dead"] for r in rules) == dead)


async def _xlen_total(r: redis.asyncio.Redis, namespace: str, shards: int, at_least: int) -> bool:
    n = sum([await r.xlen(sk.history) for sk in KeySpace(namespace, shards).all_shards()])
    return n > at_least


@pytest.mark.parametrize("value", ["-1", "abc", "true", "1.5", "2000000"])
def test_bad_history_length_is_refused_with_line_and_field(value: str) -> None:
    text = f"namespace: x\nhistory: {value}\nrules:\n  - {{name: a, match: '*', " \
           "handler: 'builtins:repr'}\n"
    with pytest.raises(ConfigError) as caught:
        Config.from_string(text, source="r.yaml")
    message = str(caught.value)
    assert message.startswith("r.yaml:2: history: must be a whole number from 0")


# -- reading: filters, order, shards --------------------------------------------------


@pytest.mark.parametrize("shards", [1, 4])
async def test_history_merges_shards_newest_first_and_filters(
        tmp_path: Path, redis_url: str, namespace: str, shards: int) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, shards=shards))
    async with node(rules, redis_url) as c:
        for i in range(6):
            c.touch_many([f"ok:{i}", f"bad:{i}"])
            await recorded(c, 2 * (i + 1))
        everything = await c.query.history(HistoryQuery(limit=100))
        assert len(everything) == 12
        orders = [r.order for r in everything]
        assert orders == sorted(orders, reverse=True)
        newest = await c.query.history(HistoryQuery(limit=3))
        assert len(newest) == 3 and {r.key for r in newest[:2]} == {"ok:5", "bad:5"}
        failed = await c.query.history(HistoryQuery(failed=True, limit=100))
        assert sorted(r.key for r in failed) == sorted(f"bad:{i}" for i in range(6))
        assert [r.key for r in await c.query.history(HistoryQuery(rule="ok", limit=2))] == [
            "ok:5", "ok:4"]
        assert [r.outcome for r in await c.query.history(HistoryQuery(key="bad:3"))] == ["failure"]


def test_history_query_refuses_a_bad_count() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="1 or more"):
            HistoryQuery(limit=bad)


# -- the CLI and status ---------------------------------------------------------------


def _fill(rules: Path, redis_url: str, keys: list[str], n: int) -> None:
    async def go() -> None:
        async with node(rules, redis_url) as c:
            c.touch_many(keys)
            await recorded(c, n)
    asyncio.run(go())


def test_cli_history(tmp_path: Path, redis_url: str, namespace: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, shards=2))
    _fill(rules, redis_url, ["ok:1", "ok:2", "bad:1"], 3)
    base = ["--rules", str(rules), "--redis", redis_url]
    capsys.readouterr()
    assert main(["history", *base]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["STARTED", "DURATION", "OUTCOME"]
    assert "ok:1" in out and "ok:2" in out and "error: RuntimeError: no such user: bad:1" in out
    assert main(["history", *base, "--failed", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["key"], r["outcome"], r["node"]) for r in rows] == [("bad:1", "failure", "node-a")]
    assert main(["history", *base, "--rule", "ok", "-n", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["rule"] == "ok"
    assert main(["history", *base, "--key", "ok:2", "--json"]) == 0
    assert [r["key"] for r in json.loads(capsys.readouterr().out)] == ["ok:2"]


def test_cli_history_errors(tmp_path: Path, redis_url: str, namespace: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    base = ["--rules", str(rules), "--redis", redis_url]
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as caught:
            main(["history", *base, "-n", bad])
        assert caught.value.code == 2
        assert "argument -n: must be a whole number of 1 or more" in capsys.readouterr().err
    assert main(["history", *base, "--rule", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no rule named 'nope'" in err and len(err.splitlines()) == 1
    assert main(["history", *base, "--key", "nomatch:1"]) == 2
    assert "no rule in" in capsys.readouterr().err


def test_format_history_of_nothing() -> None:
    assert format_history([]) == "no refreshes recorded (yet) that match"


async def test_status_counts_recent_failures_per_rule(tmp_path: Path, redis_url: str,
                                                      namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace, shards=3, attempts=3))
    async with node(rules, redis_url) as c:
        c.touch_many(["ok:1", "ok:2", "bad:1"])
        await recorded(c, 5)
        status = await c.query.status()
    assert status["rules"]["ok"]["recent"] == {"refreshes": 2, "failed": 0}
    assert status["rules"]["bad"]["recent"] == {"refreshes": 3, "failed": 3}
    assert status["rules"]["hold"]["recent"] == {"refreshes": 0, "failed": 0}
