"""A rule's keys found by capture and state, a page at a time, on a real server: every
matching key exactly once across pages (keys removed between pages included), each
page reading at most its bound of set entries, and every bad input refused by name."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.query.key_search import (
    KeyFilter,
    PageSize,
    SearchError,
    decode_cursor,
    make_filter,
    search_page,
)
from coalescer.store.keys import KeySpace
from tests.conftest import Start

RULES = """\
namespace: {ns}
shards: 3
defaults: {{window: 1h, max_wait: 2h, absorb: 5ms}}
rules:
  - name: acct
    match: "acct:{{org}}:{{user}}"
    handler: builtins:repr
  - name: plain
    match: "plain:*"
    handler: builtins:repr
"""


async def started(tmp_path: Path, namespace: str, redis_url: str, start: Start) -> Coalescer:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace))
    return await start(path, redis_url=redis_url, worker=False)


async def every_page(c: Coalescer, search: KeyFilter, scan: int,
                     between: Any = None) -> tuple[list[str], int]:
    """Every key the search finds, page after page, and the number of pages."""
    keys: list[str] = []
    cursor, pages = None, 0
    while True:
        page = await c.query.keys(search, cursor, PageSize(scan=scan, limit=scan))
        assert page.examined <= scan
        pages += 1
        keys += [f.key for f in page.keys]
        if between is not None:
            await between(page)
        cursor = page.cursor
        if cursor is None:
            return keys, pages


async def test_where_finds_each_matching_key_once_across_shards_and_pages(
        tmp_path: Path, namespace: str, redis_url: str, start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    keys = [f"acct:{org}:{user}" for org in (7, 42, 420) for user in range(20)]
    c.touch_many(keys)
    await c.flush()
    search = make_filter(c.config, "acct", where=["org=42"])
    found, pages = await every_page(c, search, scan=7)
    assert sorted(found) == sorted(k for k in keys if k.split(":")[1] == "42")
    assert len(found) == len(set(found))
    assert pages >= 60 // 7  # 60 entries read 7 at most a page
    both = make_filter(c.config, "acct", where=["org=42", "user=3"])
    assert (await every_page(c, both, scan=1000))[0] == ["acct:42:3"]
    page = await c.query.keys(search)
    assert page.keys[0].captures["org"] == "42" and page.keys[0].state == "pending"


async def test_keys_removed_between_pages_neither_repeat_nor_hide_the_rest(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    keys = [f"acct:1:{user:03d}" for user in range(40)]
    at = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    c.touch_many(keys, at=at)  # one due time: every score ties
    await c.flush()
    cancelled: set[str] = set()

    added = 0

    async def cancel_some(page: Any) -> None:  # the page's own keys, and one ahead
        nonlocal added
        named = [f.key for f in page.keys]
        space = KeySpace(namespace, 3)
        for shard in range(3):  # and keys due before all of them: every rank moves on
            added += 1
            await redis_client.zadd(space.shard(shard).due("acct"), {f"acct:2:{added}": 1})
        ahead = [k for k in keys if k not in cancelled and k not in named and k not in seen]
        drop = named[::2] + ahead[-1:]
        seen.update(named)
        cancelled.update(drop)
        await c.cancel_many(drop)

    seen: set[str] = set()
    found, _ = await every_page(c, make_filter(c.config, "acct", where=["org=1"]), scan=3,
                                between=cancel_some)
    assert len(found) == len(set(found))
    assert set(keys) - cancelled <= set(found)


async def test_a_cursor_moved_back_by_a_wrong_count_still_finds_every_key_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    keys = [f"acct:1:{user:03d}" for user in range(60)]
    c.touch_many(keys)
    await c.flush()
    search = make_filter(c.config, "acct")
    space = KeySpace(namespace, 3)
    found: list[str] = []
    guesses = iter([0, 1, 5, 100, 2, 3] * 20)  # right, too few, too many
    at = None
    while True:
        page = await search_page(redis_client, c.config, search, at, PageSize(scan=4, limit=4))
        found += [f.key for f in page.keys]
        for f in page.keys[::2]:  # take some of the page's keys out of the set
            await redis_client.zrem(space.shard(f.shard).due("acct"), f.key)
        if page.next is None:
            break
        at = page.next.moved_back(next(guesses))
    assert sorted(found) == keys


async def test_states_scheduled_dead_in_flight_and_paused(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    c = await started(tmp_path, namespace, redis_url, start)
    c.touch_many(["acct:1:a", "acct:1:b"])
    c.touch("acct:1:later", delay="2h")
    await c.flush()
    space = KeySpace(namespace, 3)
    sk = space.shard(space.shard_of("acct:1:dead"))
    await redis_client.hset(sk.meta, "acct:1:dead", "D|1|1|5|boom")
    since = int(time.time() * 1000)
    await redis_client.zadd(sk.dead("acct"), {"acct:1:dead": since})
    await redis_client.zadd(sk.inflight("acct"), {"acct:1:run": 99})

    async def of(state: str) -> list[str]:
        return sorted((await every_page(c, make_filter(c.config, "acct", state=state),
                                        scan=1000))[0])

    assert await of("pending") == ["acct:1:a", "acct:1:b", "acct:1:later"]
    assert await of("scheduled") == ["acct:1:later"]
    assert await of("dead") == ["acct:1:dead"]
    assert await of("in-flight") == ["acct:1:run"]
    dead = await c.query.keys(make_filter(c.config, "acct", state="dead"))
    assert dead.keys[0].at_ms == since
    unpaused = await c.query.keys(make_filter(c.config, "acct", state="paused"))
    assert (unpaused.keys, unpaused.paused, unpaused.cursor) == ([], False, None)
    await c.query.pause("acct")
    assert await of("paused") == ["acct:1:a", "acct:1:b", "acct:1:later"]


def config_of(tmp_path: Path) -> Any:
    from coalescer.config.rules import Config
    return Config.from_string(RULES.format(ns="ns"), base_dir=tmp_path)


@pytest.mark.parametrize(("where", "state", "part", "says"), [
    (["org"], None, "where", "--where 'org': expected CAPTURE=VALUE, e.g. org=42"),
    (["=42"], None, "where", "expected CAPTURE=VALUE"),
    (["team=1"], None, "where", "has no capture 'team' (its captures: org, user)"),
    (["org=1", "org=2"], None, "where", "given twice with different values"),
    ([], "waiting", "state", "--state 'waiting': not a state; one of pending, scheduled, "
                             "in-flight, dead, paused"),
])
def test_a_bad_filter_is_refused_naming_the_part(tmp_path: Path, where: list[str],
                                                 state: str | None, part: str,
                                                 says: str) -> None:
    with pytest.raises(SearchError) as caught:
        make_filter(config_of(tmp_path), "acct", state=state, where=where)
    assert caught.value.part == part and says in str(caught.value)


def test_an_unknown_rule_a_rule_without_captures_and_a_bad_cursor_are_refused(
        tmp_path: Path) -> None:
    config = config_of(tmp_path)
    with pytest.raises(SearchError, match=r"no rule named 'nope' \(its rules: acct, plain\)"):
        make_filter(config, "nope")
    with pytest.raises(SearchError, match="it captures nothing"):
        make_filter(config, "plain", where=["x=1"])
    search = make_filter(config, "acct", where=["org=1"])
    for bad in ("garbage!", "eyJ2IjoyfQ", "x" * 5000):
        with pytest.raises(SearchError) as caught:
            decode_cursor(bad, search)
        assert caught.value.part == "cursor"
    from coalescer.query.key_search import Cursor
    other = Cursor(1, ("5", "acct:1:x", 3)).encode(make_filter(config, "acct", where=["org=2"]))
    with pytest.raises(SearchError, match="a cursor of another search"):
        decode_cursor(other, search)
    good = Cursor(1, ("5", "k", 7))
    assert decode_cursor(good.encode(search), search) == good
    for scan in (0, 10_001, True):
        with pytest.raises(SearchError, match="scan must be a whole number from 1 to 10000"):
            PageSize(scan=scan)
