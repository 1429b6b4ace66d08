"""Changing ``shards`` with the fleet running: a node started with a new count begins
a live reshard; every key, with its claim, items, backoff or dead letter, ends up in
its new shard; no key runs twice at once and no touch is lost meanwhile."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from coalescer import Coalescer
from coalescer.errors import RedisRefusesWritesError
from coalescer.query.history import HistoryQuery
from coalescer.query.status import format_status
from coalescer.store import key_states
from coalescer.store import layout as layout_module
from coalescer.store.keys import KeySpace, layout
from coalescer.store.layout import Layouts, Taken
from coalescer.worker.resharding import begin_reshard
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.servers import Cluster, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
rules:
  - name: stats
    match: "stats:{{id}}"
    window: {window}
    max_wait: {max_wait}
    handler: {mod}:refresh
  - name: orders
    match: "orders:{{id}}"
    window: {window}
    max_wait: {max_wait}
    items: {{max: 100}}
    handler: {mod}:refresh
"""


def rules(tmp_path: Path, namespace: str, shards: int, *, window: str = "60s",
          name: str = "", max_wait: str = "10m") -> tuple[Path, Recorder]:
    folder = tmp_path / f"s{shards}{name}"
    folder.mkdir(exist_ok=True)
    return recorder_rules(folder, f"reshard_{namespace}_{shards}{name}",
                          RULES.format(ns=namespace, shards=shards, window=window,
                                       max_wait=max_wait, mod="{mod}"))


async def layout_of(redis: Redis, namespace: str) -> dict[str, str]:
    return dict(await redis.hgetall(layout(namespace)))


async def reshard_done(redis: Redis, namespace: str, shards: int) -> bool:
    got = await layout_of(redis, namespace)
    return got.get("shards") == str(shards) and got.get("from") == "0"


async def where(redis: Redis, namespace: str, key: str, span: int) -> list[int]:
    """The shards whose meta hash holds ``key``."""
    space = KeySpace(namespace, span)
    return [n for n in range(span) if await redis.hexists(space.shard(n).meta, key)]


async def test_a_node_with_a_new_shards_value_moves_every_pending_key_to_its_new_shard(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 2)
    new, _ = rules(tmp_path, namespace, 8)
    hostile = ["stats:\x1b[2J\x1b]52;c;aGk=\x07", "stats:line1\nFAKE", "stats:é\u200b\"{}"]
    keys = [f"stats:{i}" for i in range(300)] + hostile  # bytes that JSON must carry
    moved = next(k for k in (f"stats:later-{i}" for i in range(64))
                 if KeySpace(namespace, 2).shard_of(k) != KeySpace(namespace, 8).shard_of(k))
    async with Coalescer.from_yaml(old, redis_url=redis_url, node_id="a") as a:
        for key in keys:
            a.touch(key)
        a.touch("orders:1", "row-1")
        a.touch("orders:1", "row-2")
        await a.flush()
        a.touch("stats:7")  # a second write: its burst counts two touches, and moves so
        a.touch(moved, delay=3600)  # a time of its own, which it keeps
        await a.flush()
        before = await redis_client.hget(a.keyspace.shard(a.keyspace.shard_of("stats:7")).meta,
                                         "stats:7")
        later = await redis_client.hget(a.keyspace.shard(a.keyspace.shard_of(moved)).meta,
                                        moved)
        burst = key_states.pending(str(before))
        assert burst is not None and burst.touches == 2
        async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
            await wait_until(lambda: reshard_done(redis_client, namespace, 8), timeout=30,
                             message="the reshard from 2 to 8 shards to end")
            assert a.keyspace.shards == 8  # the node on the old file follows the namespace

    space = KeySpace(namespace, 8)
    assert any(KeySpace(namespace, 2).shard_of(k) != space.shard_of(k) for k in hostile)
    for key in [*keys, "orders:1"]:
        assert await where(redis_client, namespace, key, 8) == [space.shard_of(key)], key
    home = space.shard(space.shard_of("stats:7"))
    assert await redis_client.hget(home.meta, "stats:7") == before  # the same burst
    assert await redis_client.hget(space.shard(space.shard_of(moved)).meta,
                                   moved) == later  # still a scheduled one
    assert await redis_client.zscore(home.due("stats"), "stats:7") is not None
    orders = space.shard(space.shard_of("orders:1"))
    assert await redis_client.smembers(orders.items("orders:1")) == {"row-1", "row-2"}
    for n in range(8):  # nothing is left in transit
        assert await redis_client.hlen(space.shard(n).moving) == 0


async def test_touches_during_a_reshard_are_all_refreshed_and_no_key_runs_twice_at_once(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, rec = rules(tmp_path, namespace, 2, window="100ms", max_wait="200ms")
    new = same_handler(old, 8)
    keys = [f"stats:{i}" for i in range(60)]
    last: dict[str, int] = {}

    done = asyncio.Event()

    async def writes(c: Coalescer) -> None:
        after = 0
        while after < 3:  # until three rounds after the reshard ended
            after += done.is_set()
            for key in keys:
                c.touch(key)
            await c.flush()
            last.update(dict.fromkeys(keys, await server_ms(redis_client)))

    async with Coalescer.from_yaml(old, redis_url=redis_url, node_id="a") as a, \
            Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        writing = asyncio.ensure_future(writes(writer))
        await wait_until(lambda: len(rec.calls) > 0, message="refreshes before the reshard")
        async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b") as b:
            await wait_until(lambda: reshard_done(redis_client, namespace, 8), timeout=30,
                             message="the reshard to end")
            done.set()
            await writing
            await wait_until(lambda: all_refreshed(rec, last), timeout=30,
                             message="every key refreshed after its last touch")
            assert a.keyspace.shards == b.keyspace.shards == 8
    assert max(rec.max_active.values()) == 1  # one node: one refresh of a key at a time
    for key in keys:
        tokens = [c.token for c in rec.calls if c.key == key]
        assert tokens == sorted(set(tokens)), f"{key}: tokens {tokens} do not only grow"


def same_handler(path: Path, shards: int) -> Path:
    """Another rules file beside ``path``, with ``shards``, calling the same handler."""
    text = path.read_text()
    other = path.with_name(f"rules{shards}.yaml")
    other.write_text(text.replace("shards: ", f"shards: {shards}\n#", 1))
    return other


def all_refreshed(rec: Recorder, last: dict[str, int]) -> bool:
    started: dict[str, int] = {}
    for c in rec.succeeded:
        started[c.key] = max(started.get(c.key, 0), c.last_touch_ms)
    return all(started.get(key, 0) >= ms - 5 for key, ms in last.items())


async def server_ms(redis: Any) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_node_restarted_with_the_old_file_follows_instead_of_resharding_back(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    old, _ = rules(tmp_path, namespace, 2)
    new, _ = rules(tmp_path, namespace, 4)
    async with Coalescer.from_yaml(old, redis_url=redis_url, node_id="a"):
        pass
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
    async with Coalescer.from_yaml(old, redis_url=redis_url, node_id="a") as a:
        assert a.keyspace.shards == 4
    assert (await layout_of(redis_client, namespace))["shards"] == "4"
    assert "follows the namespace" in caplog.text


async def test_a_writer_of_the_old_layout_is_sent_to_read_the_new_one(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 1)
    new, _ = rules(tmp_path, namespace, 4)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        writer.touch("stats:0")
        await writer.flush()
        async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
            await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                             message="the reshard to end")
        assert writer.keyspace.gen == 1  # nothing told it yet
        keys = [f"stats:{i}" for i in range(1, 40)]
        for key in keys:
            writer.touch(key)
        await writer.flush()
        assert writer.keyspace.shards == 4 and writer.keyspace.gen == 3
    space = KeySpace(namespace, 4)
    for key in ["stats:0", *keys]:
        assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)], key


async def test_bundles_a_dead_mover_left_are_put_by_the_next_leader(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 1)
    new, _ = rules(tmp_path, namespace, 4)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        for i in range(20):
            writer.touch(f"stats:{i}")
        await writer.flush()
        # a mover took the keys out of shard 0 and died before putting them
        layouts = Layouts(writer._run.scripts, namespace, 1)  # type: ignore[arg-type]
        await layouts.refresh()
        assert await layouts.begin(4, "ghost")
        space = layouts.keyspace
        keys = [f"stats:{i}" for i in range(20)]
        moving = [k for k in keys if space.shard_of(k) != 0]
        taken = await layouts.take(space.shard(0), space.gen, moving,
                                   [space.shard_of(k) for k in moving], ["stats"])
        assert taken is not None and set(taken.bundles) == set(moving)
        assert await redis_client.hlen(space.shard(0).moving) == len(moving)
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
    final = KeySpace(namespace, 4)
    for key in keys:
        assert await where(redis_client, namespace, key, 4) == [final.shard_of(key)], key
    assert await redis_client.hlen(final.shard(0).moving) == 0


async def taken_by_a_dead_mover(writer: Coalescer, keys: list[str], rule: str,
                                item: str | None = None) -> tuple[KeySpace, list[str], Taken]:
    """Touch ``keys`` (with ``item``), begin a reshard from 1 to 4 shards, and take the
    keys bound for other shards out of shard 0 as a mover that then died would: the
    layout, those keys and what the take returned."""
    for key in keys:
        if item is None:
            writer.touch(key)
        else:
            writer.touch(key, item)
    await writer.flush()
    layouts = writer._run.layouts
    assert layouts is not None and await layouts.begin(4, "ghost")
    space = layouts.keyspace
    moving = [k for k in keys if space.shard_of(k) != 0]
    taken = await layouts.take(space.shard(0), space.gen, moving,
                               [space.shard_of(k) for k in moving], [rule])
    assert taken is not None and set(taken.bundles) == set(moving)
    return space, moving, taken


async def test_a_touch_of_a_key_a_dead_mover_left_in_transit_brings_it_along(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    """A mover took keys out of their old shard and died before putting them. A touch
    of such a key puts what its old shard held into its new shard first: the refresh
    claimed there gets the items touched before the move too, and runs once."""
    old, _ = rules(tmp_path, namespace, 1, window="200ms")
    new, rec = rules(tmp_path, namespace, 4, window="200ms", name="new")
    keys = [f"orders:{i}" for i in range(20)]
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        space, moving, _ = await taken_by_a_dead_mover(writer, keys, "orders", "before")
        for key in moving:
            writer.touch(key, "after")
        await writer.flush()
        for key in moving:
            home = space.shard(space.shard_of(key))
            assert await redis_client.smembers(home.items(key)) == {"before", "after"}, key
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
        await wait_until(lambda: all(rec.of(k) for k in keys), timeout=30,
                         message="every key refreshed")
    for key in moving:
        assert [sorted(c.items) for c in rec.of(key)] == [["after", "before"]], key
    assert await redis_client.hlen(space.shard(0).moving) == 0


async def test_a_key_in_transit_whose_new_shard_refuses_it_stays_buffered_until_it_can(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        key = next(f"orders:{i}" for i in range(100) if KeySpace(namespace, 4).shard_of(
            f"orders:{i}") != 0)
        writer.touch(key, "before")
        await writer.flush()
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "ghost")
        space = layouts.keyspace
        home = space.shard(space.shard_of(key))
        assert await layouts.take(space.shard(0), space.gen, [key], [space.shard_of(key)],
                                  ["orders"]) is not None
        await redis_client.set(home.arrived, "not a hash")  # the put fails: WRONGTYPE
        writer.touch(key, "after")
        with pytest.raises(RedisRefusesWritesError, match="WRONGTYPE"):
            await writer.flush()
        assert not await redis_client.hexists(home.meta, key)
        assert len(writer._run.absorber) == 1  # given back, not lost
        await redis_client.delete(home.arrived)
        await writer.flush()  # the touch was kept: written now, with what it carried
        assert await redis_client.smembers(home.items(key)) == {"before", "after"}


async def test_a_cancel_of_a_key_in_transit_cancels_it_and_a_later_mover_does_not_bring_it_back(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 1)
    new, _ = rules(tmp_path, namespace, 4, name="new")
    keys = [f"orders:{i}" for i in range(20)]
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        _, moving, _ = await taken_by_a_dead_mover(writer, keys, "orders", "row")
        outcome = await writer.cancel_many(moving)  # their mover died before putting them
        assert outcome.cancelled == moving and set(outcome.states.values()) == {"pending"}
        entries = await writer.query.history(HistoryQuery(key=moving[0]))
        assert [e.outcome for e in entries] == ["cancelled"]
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
    for key in moving:
        assert await where(redis_client, namespace, key, 4) == [], key  # not brought back
    for key in set(keys) - set(moving):
        assert await where(redis_client, namespace, key, 4) == [0], key


async def test_a_writer_learns_that_a_reshard_ended_though_no_shard_refused_its_writes(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node that ended a reshard died before raising the shards' markers: nothing
    refuses the writer's held writes, so it reads the layout again on its own."""
    monkeypatch.setattr(layout_module, "RECHECK", 0.0)  # at once, not 5 s later
    old, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "ghost")
        space = layouts.keyspace
        assert await layouts.drained(space.gen, 0, 0)  # ended; the markers stay as they were
        assert writer.keyspace.resharding
        key = next(k for k in (f"stats:{i}" for i in range(100)) if space.shard_of(k) != 0)
        writer.touch(key)
        await writer.flush()
        assert not writer.keyspace.resharding and writer.keyspace.shards == 4
        writer.touch(key)
        await writer.flush()
    assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)]


async def test_a_writer_that_cannot_read_the_layout_again_writes_with_the_one_it_has(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path, *,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(layout_module, "RECHECK", 0.0)
    caplog.set_level(logging.INFO, logger="coalescer.write.flusher")
    old, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "test")
        space = layouts.keyspace
        saved = await redis_client.hgetall(layout(namespace))
        await redis_client.delete(layout(namespace))
        await redis_client.set(layout(namespace), "not a hash")  # the read fails: WRONGTYPE
        try:
            key = next(k for k in (f"stats:{i}" for i in range(100)) if space.shard_of(k) != 0)
            writer.touch(key)
            await writer.flush()  # held in the old shard, asked, written to the new one
        finally:
            await redis_client.delete(layout(namespace))
            await redis_client.hset(layout(namespace), mapping=saved)
    assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)]
    lines = [r.getMessage() for r in caplog.records
             if "reading the shard layout again failed" in r.getMessage()]
    assert lines and all("ResponseError" in line for line in lines)


async def test_a_writer_of_the_old_layout_is_sent_to_read_it_as_soon_as_a_reshard_begins(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    """No mover has run yet (no worker node): the node that began the reshard raised the
    old shards' markers, so a writer still on 1 shard does not write by it any more."""
    old, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        assert writer.keyspace.shards == 1 and not writer.keyspace.resharding
        node = Layouts(writer._run.scripts, namespace, 4)  # type: ignore[arg-type]
        await node.refresh()
        assert await begin_reshard(node, 4, "b")
        space = node.keyspace
        assert await redis_client.get(space.shard(0).layout) == str(space.gen)
        key = next(k for k in (f"stats:{i}" for i in range(100)) if space.shard_of(k) != 0)
        writer.touch(key)
        await writer.flush()
        assert writer.keyspace.resharding  # refused once, read the layout, wrote again
    assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)]


@pytest.mark.parametrize(("before", "after"), [(1, 4), (4, 1)])
async def test_refreshes_before_a_reshard_stay_in_the_history(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path, *, before: int,
        after: int) -> None:
    """A history entry stays in the stream of the shard that ran it: after the reshard,
    ``history`` reads that shard too, by key and unfiltered."""
    old, rec = rules(tmp_path, namespace, before, window="100ms")
    new = same_handler(old, after)
    keys = [f"stats:{i}" for i in range(12)]
    moved = [k for k in keys if KeySpace(namespace, before).shard_of(k)
             != KeySpace(namespace, after).shard_of(k)]
    assert moved
    async with Coalescer.from_yaml(old, redis_url=redis_url, node_id="a") as a:
        a.touch_many(keys)
        await wait_until(lambda: {c.key for c in rec.succeeded} >= set(keys),
                         message="every key refreshed")
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b") as b:
        await wait_until(lambda: reshard_done(redis_client, namespace, after), timeout=30,
                         message="the reshard to end")
        for key in moved:
            entries = await b.query.history(HistoryQuery(key=key))
            assert [(e.key, e.outcome) for e in entries] == [(key, "success")], key
            explained = await b.query.explain(key)
            assert [r["outcome"] for r in explained["last_refreshes"]] == ["success"], key
        everything = await b.query.history(HistoryQuery(limit=100))
        assert {e.key for e in everything} >= set(keys)


async def test_while_a_reshard_runs_a_key_not_moved_yet_is_touched_in_its_old_shard(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    """No mover runs here (no worker node): the keys stay in their old shard, and a
    touch finds them there; a key the old shard does not hold goes to its new one."""
    path, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as writer:
        stay = [f"stats:{i}" for i in range(40)]
        for key in stay:
            writer.touch(key)
        await writer.flush()
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "test")
        space = writer.keyspace
        assert space.resharding and space.source == 1 and space.shards == 4
        fresh = [f"stats:new{i}" for i in range(40)]
        for key in stay + fresh:
            writer.touch(key)
        await writer.flush()
    for key in stay:
        assert await where(redis_client, namespace, key, 4) == [0], key
    for key in fresh:
        assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)], key


FAILING = """\
namespace: {ns}
shards: {shards}
leader_lease: 1s
rules:
  - name: fails
    match: "fails:{{id}}"
    window: 100ms
    retry: {{attempts: {attempts}, backoff: 10m, max_backoff: 10m}}
    handler: {mod}:refresh
"""


async def test_a_dead_letter_and_a_retry_backoff_move_with_their_key(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    path, rec = recorder_rules(tmp_path, f"fails_{namespace}",
                               FAILING.format(ns=namespace, shards=1, attempts=1, mod="{mod}"))
    retrying = tmp_path / "retrying.yaml"
    retrying.write_text(path.read_text().replace("attempts: 1", "attempts: 3"))

    async def boom(claim: Any) -> None:
        raise RuntimeError(f"no {claim.key}")

    rec.hook = boom
    dead_keys = [f"fails:d{i}" for i in range(6)]
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        for key in dead_keys:
            a.touch(key)
        await wait_until(lambda: dead_count(a, 6), message="six dead letters")
    async with Coalescer.from_yaml(retrying, redis_url=redis_url, node_id="a") as a:
        a.touch("fails:later")
        await wait_until(lambda: len(rec.of("fails:later")) == 1, message="a first failure")
        await wait_until(lambda: backing_off(a, "fails:later"), message="its backoff")
    bigger = same_handler(retrying, 4)
    async with Coalescer.from_yaml(bigger, redis_url=redis_url, node_id="b") as b:
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
        page = await b.query.dead_letters(limit=10)
        assert sorted(e["key"] for e in page.entries) == dead_keys
        assert {e["attempts"] for e in page.entries} == {1}
        assert all("RuntimeError" in e["error"] for e in page.entries)
        explained = await b.query.explain("fails:later")
        assert explained["shard"] == b.keyspace.shard_of("fails:later")
        assert explained["state"] == "backoff" and explained["attempts"] == 1
        rec.hook = None
        outcome = await b.query.retry_dead(dead_keys)
        assert outcome.done == 6
        await wait_until(lambda: all(len(rec.of(k)) == 2 for k in dead_keys),
                         message="every dead key re-run in its new shard")
    for key in dead_keys:  # refreshed for good: no state left anywhere else
        found = await where(redis_client, namespace, key, 4)
        assert set(found) <= {KeySpace(namespace, 4).shard_of(key)}, key


async def dead_count(c: Coalescer, n: int) -> bool:
    return (await c.query.dead_letters(limit=50)).total == n


async def backing_off(c: Coalescer, key: str) -> bool:
    explained = await c.query.explain(key)
    return bool(explained.get("state") == "backoff" and explained.get("attempts") == 1)


async def test_a_dead_letters_items_reach_its_next_try_after_the_move_and_a_schedule(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    text = FAILING.format(ns=namespace, shards=1, attempts=1, mod="{mod}")
    path, rec = recorder_rules(tmp_path, f"items_{namespace}", text + "    items: {max: 4}\n")
    key = next(k for k in (f"fails:i{i}" for i in range(100))
               if KeySpace(namespace, 4).shard_of(k) != 0)  # one that moves

    async def boom(claim: Any) -> None:
        raise RuntimeError(f"no {claim.key}")

    rec.hook = boom
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="a") as a:
        a.touch(key, "i1")
        await wait_until(lambda: dead_count(a, 1), message="a dead letter")
    rec.hook = None
    async with Coalescer.from_yaml(same_handler(path, 4), redis_url=redis_url,
                                   node_id="b") as b:
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
        assert await where(redis_client, namespace, key, 4) == [b.keyspace.shard_of(key)]
        seconds, _ = await redis_client.time()
        b.touch_many([key], at=int(seconds))  # a time of its own, past: due at once
        await wait_until(lambda: len(rec.calls) == 2, message="its next try")
    assert [(c.attempt, c.items) for c in rec.calls] == [(1, ("i1",)), (1, ("i1",))]


async def test_status_shows_a_reshard_while_it_runs_and_when_it_ended(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    path, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as writer:
        writer.touch("stats:1")
        await writer.flush()
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "test")
        status = await writer.query.status()
        assert status["layout"]["resharding_from"] == 1 and status["layout"]["shards"] == 4
        assert len(status["shards"]) == 4
        text = format_status(status, await server_ms(redis_client))
        assert "resharding from 1 to 4 shards" in text and "0 of 1 old shards drained" in text
    bigger = same_handler(path, 4)
    async with Coalescer.from_yaml(bigger, redis_url=redis_url, node_id="b") as b:
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
        status = await b.query.status()
        text = format_status(status, await server_ms(redis_client))
    assert status["layout"]["resharding_from"] is None and status["layout"]["last_from"] == 1
    assert "resharded from 1 to 4 shards, done" in text
    assert status["rules"]["stats"]["pending"] == 1


async def test_on_a_cluster_keys_move_between_masters_and_every_one_is_refreshed(
        tmp_path: Path, namespace: str, cluster: Cluster) -> None:
    old, rec = rules(tmp_path, namespace, 2, window="100ms", max_wait="200ms")
    new = same_handler(old, 6)
    keys = [f"stats:{i}" for i in range(200)]
    async with Coalescer.from_yaml(old, redis_url=cluster.urls[0], worker=False) as writer:
        writer.touch_many(keys)
        await writer.flush()
        async with Coalescer.from_yaml(new, redis_url=cluster.urls[1], node_id="b") as b:
            await wait_until(lambda: reshard_done(b.redis, namespace, 6), timeout=30,
                             message="the reshard to end")
            writer.touch_many(keys)  # a writer of the old layout: sent to the new one
            await writer.flush()
            await wait_until(lambda: all(len(rec.of(k)) >= 2 for k in keys), timeout=30,
                             message="every key refreshed again after the reshard")
            owners = {b.redis.get_node_from_key(sk.meta).name
                      for sk in KeySpace(namespace, 6).all_shards()}
            assert writer.keyspace.shards == 6 and len(rec.max_active) == len(keys)
    assert max(rec.max_active.values()) == 1
    assert len(owners) > 1  # the shards live on more than one master


async def test_on_a_cluster_a_touch_brings_a_key_left_in_transit_to_another_master(
        tmp_path: Path, namespace: str, cluster: Cluster) -> None:
    old, _ = rules(tmp_path, namespace, 1, window="200ms")
    new, rec = rules(tmp_path, namespace, 4, window="200ms", name="new")
    keys = [f"orders:{i}" for i in range(20)]
    async with Coalescer.from_yaml(old, redis_url=cluster.urls[0], worker=False) as writer:
        space, moving, _ = await taken_by_a_dead_mover(writer, keys, "orders", "before")
        for key in moving:
            writer.touch(key, "after")
        await writer.flush()
        r = writer.redis
        masters = {r.get_node_from_key(space.shard(space.shard_of(k)).meta).name
                   for k in moving}
        assert masters - {r.get_node_from_key(space.shard(0).meta).name}
        for key in moving:
            home = space.shard(space.shard_of(key))
            assert await r.smembers(home.items(key)) == {"before", "after"}, key
    async with Coalescer.from_yaml(new, redis_url=cluster.urls[1], node_id="b"):
        await wait_until(lambda: all(rec.of(k) for k in keys), timeout=30,
                         message="every key refreshed")
    for key in moving:
        assert [sorted(c.items) for c in rec.of(key)] == [["after", "before"]], key


async def test_a_node_with_a_third_count_during_a_reshard_follows_it_and_says_so(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path, _ = rules(tmp_path, namespace, 1)
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as writer:
        layouts = writer._run.layouts
        assert layouts is not None and await layouts.begin(4, "test")
    third = same_handler(path, 8)
    async with Coalescer.from_yaml(third, redis_url=redis_url, node_id="c") as c:
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the running reshard (to 4) to end")
        assert c.keyspace.shards == 4
    assert "says shards: 8, the namespace has 4 (a reshard from 1 runs)" in caplog.text


async def test_a_bundle_put_before_its_mover_died_is_not_put_again(
        redis_url: str, redis_client: Redis, namespace: str, tmp_path: Path) -> None:
    old, _ = rules(tmp_path, namespace, 1)
    new, _ = rules(tmp_path, namespace, 4, name="new")
    async with Coalescer.from_yaml(old, redis_url=redis_url, worker=False) as writer:
        keys = [f"stats:{i}" for i in range(20)]
        space, moving, taken = await taken_by_a_dead_mover(writer, keys, "stats")
        layouts = writer._run.layouts
        assert layouts is not None
        for key, bundle in taken.bundles.items():  # put, then the mover died
            assert await layouts.put(space.shard(space.shard_of(key)), taken.seq,
                                     [bundle]) == 1
        gone = moving[0]  # refreshed since in its new shard: no state left
        home = space.shard(space.shard_of(gone))
        await redis_client.hdel(home.meta, gone)
        await redis_client.zrem(home.due("stats"), gone)
    async with Coalescer.from_yaml(new, redis_url=redis_url, node_id="b"):
        await wait_until(lambda: reshard_done(redis_client, namespace, 4), timeout=30,
                         message="the reshard to end")
    assert await where(redis_client, namespace, gone, 4) == []  # not brought back
    for key in moving[1:]:
        assert await where(redis_client, namespace, key, 4) == [space.shard_of(key)], key
    for n in range(4):
        assert not await redis_client.exists(space.shard(n).arrived)  # dropped at the end
