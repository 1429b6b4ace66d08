"""Items: a touch may carry an item; a refresh gets the distinct items touched since its
key's previous claim (``claim.items``), or is told they overflowed."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError

from coalescer import Claim, Coalescer, InvalidItemError, InvalidKeyError, SyncCoalescer
from coalescer.config.rules import Config
from coalescer.errors import ConfigError, RedisUnreachableError
from coalescer.query.explain import format_explain
from coalescer.store.keycheck import MAX_ITEM_BYTES
from coalescer.store.keys import KeySpace
from coalescer.store.script_types import UpsertGroup
from coalescer.store.scripts import Scripts
from coalescer.worker.registry import fingerprint
from tests.helpers.servers import wait_until
from tests.worker.test_webhooks import Receiver, receiver  # noqa: F401 (a fixture)

HANDLERS = """\
import asyncio

calls = []
fail = set()  # keys whose refresh raises
gate = asyncio.Event()  # keys in `held` wait on it
held = set()


async def refresh(claim):
    calls.append(claim)
    if claim.key in held:
        await gate.wait()
    if claim.key in fail:
        raise RuntimeError("planned failure of " + claim.key)


async def refresh_batch(claims):
    calls.append(list(claims))
    return [c for c in claims if c.key in fail]
"""

RULES = """\
namespace: {ns}
shards: {shards}
claim_lease: {lease}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  retry: {{attempts: {attempts}, backoff: 10ms, max_backoff: 10ms}}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: handlers:refresh
    items: {{max: {max}}}
  - name: plain
    match: "plain:{{id}}"
    handler: handlers:refresh
  - name: bunch
    match: "bunch:{{id}}"
    handler: handlers:refresh_batch
    batch: {{max: 10, wait: 0s}}
    items: {{max: {max}}}
"""

Start = Callable[..., Awaitable[tuple[Coalescer, Any]]]


@pytest_asyncio.fixture
async def start(namespace: str, redis_url: str, rules_file: Any) -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:
        async def make(*, worker: bool = False, most: int = 5, attempts: int = 3,
                       shards: int = 1, lease: str = "5s",
                       url: str | None = None) -> tuple[Coalescer, Any]:
            path = rules_file(RULES.format(ns=namespace, max=most, attempts=attempts,
                                           shards=shards, lease=lease), HANDLERS)
            config = Config.from_yaml(path)  # imports the handlers module
            c = Coalescer(config, redis_url=url or redis_url, worker=worker, grace=1.0)
            await stack.enter_async_context(c)
            return c, sys.modules["handlers"]

        yield make


def runs(handlers: Any) -> list[Claim]:
    out: list[Claim] = []
    for call in handlers.calls:
        out += call if isinstance(call, list) else [call]
    return out


async def test_a_refresh_gets_the_distinct_items_touched_since_the_last_claim_once(
        start: Start) -> None:
    c, _ = await start()
    c.touch("stats:customer:1", "order:2")
    c.touch("stats:customer:1", "order:1")
    c.touch("stats:customer:1", "order:2")
    c.touch("stats:customer:1")  # a plain touch of the same key adds nothing
    c.touch_items([("stats:customer:2", "order:9"), ("stats:customer:1", "order:3")])
    done = await c.drain()
    got = {claim.key: (claim.items, claim.items_overflowed) for claim in done}
    assert got == {"stats:customer:1": (("order:1", "order:2", "order:3"), False),
                   "stats:customer:2": (("order:9",), False)}
    c.touch("stats:customer:1", "order:4")
    again = await c.drain()
    assert [(x.key, x.items) for x in again] == [("stats:customer:1", ("order:4",))]
    c.touch("stats:customer:1")
    assert [x.items for x in await c.drain()] == [()]  # delivered once: never again
    shard = c.keyspace.shard(0)
    assert not await c.redis.exists(shard.items("stats:customer:1"),
                                    shard.claimed_items("stats:customer:1"))


async def test_a_rule_without_items_gets_empty_items_and_refuses_an_item(
        start: Start) -> None:
    c, _ = await start()
    c.touch("plain:1")
    with pytest.raises(InvalidItemError, match="rule 'plain' takes no items"):
        c.touch("plain:2", "x")
    with pytest.raises(InvalidItemError, match="rule 'plain' takes no items"):
        c.touch_items([("stats:customer:1", "a"), ("plain:2", "x")])
    [claim] = await c.drain()
    assert (claim.key, claim.items, claim.items_overflowed) == ("plain:1", (), False)
    c.touch("stats:customer:1")
    assert [x.key for x in await c.drain()] == ["stats:customer:1"]  # touch_items: none


@pytest.mark.parametrize(("item", "why"), [
    ("", "must not be empty"),
    (7, "must be a str, not int"),
    ("a\0b", "NUL character"),
    ("x" * (MAX_ITEM_BYTES + 1), f"over the limit of {MAX_ITEM_BYTES}"),
    ("\ud800", "lone surrogate"),
])
async def test_a_bad_item_is_refused_like_a_bad_key_and_nothing_is_touched(
        start: Start, item: Any, why: str) -> None:
    c, _ = await start()
    with pytest.raises(InvalidItemError, match=why) as caught:
        c.touch("stats:customer:1", item)
    assert caught.value.key == "stats:customer:1"
    with pytest.raises(InvalidItemError, match=why):
        c.touch_items([("stats:customer:2", "fine"), ("stats:customer:3", item)])
    with pytest.raises(InvalidKeyError):
        c.touch("stats:customer:\0", "fine")
    assert await c.drain() == []


async def test_items_past_max_overflow_and_are_counted(start: Start) -> None:
    c, _ = await start(most=3, worker=True)
    for i in range(5):  # five in process: three kept, then the overflow mark
        c.touch("stats:customer:1", f"o{i}")
    await c.flush()
    for i in range(5, 8):  # and in Redis, past what is there
        c.touch("stats:customer:2", f"o{i}")
        await c.flush()
    c.touch("stats:customer:2", "o9")
    done = {x.key: x for x in await c.drain()}
    one, two = done["stats:customer:1"], done["stats:customer:2"]
    assert one.items_overflowed and len(one.items) == 3
    assert set(one.items) < {f"o{i}" for i in range(5)}
    assert two.items_overflowed and two.items == ("o5", "o6", "o7")
    counted = c.metrics.registry.get_sample_value(
        "coalescer_item_overflows_total", {"rule": "customer"})
    assert counted == 2
    c.touch("stats:customer:1", "o1")
    [after] = await c.drain()
    assert (after.items, after.items_overflowed) == (("o1",), False)  # a fresh start


async def test_items_touched_during_a_run_go_to_the_next_run(start: Start) -> None:
    c, h = await start(worker=True)
    h.held.add("stats:customer:1")
    c.touch("stats:customer:1", "before")
    await c.flush()
    await wait_until(lambda: len(h.calls) == 1, message="the first run")
    c.touch("stats:customer:1", "during")
    await c.flush()
    h.gate.set()
    await wait_until(lambda: len(h.calls) == 2, message="the re-armed run")
    assert [x.items for x in h.calls] == [("before",), ("during",)]


async def test_a_failed_try_gives_its_items_again_to_the_retry_and_the_dead_letters_retry(
        start: Start) -> None:
    c, h = await start(attempts=2)
    h.fail.add("stats:customer:1")
    c.touch("stats:customer:1", "a")
    first = await c.drain()
    assert [(x.attempt, x.items) for x in first] == [(1, ("a",)), (2, ("a",))]
    assert [d["key"] for d in (await c.query.status())["dead_letters"]] == ["stats:customer:1"]
    c.touch("stats:customer:1", "b")  # a new touch re-queues the dead key
    h.fail.clear()
    assert [(x.attempt, x.items) for x in await c.drain()] == [(1, ("a", "b"))]
    h.fail.add("stats:customer:2")
    c.touch("stats:customer:2", "c")
    await c.drain()
    h.fail.clear()
    assert await c.query.retry_dead(["stats:customer:2"]) is not None
    assert [(x.key, x.items) for x in await c.drain()] == [("stats:customer:2", ("c",))]


async def test_a_purged_dead_key_loses_its_items(start: Start) -> None:
    c, h = await start(attempts=1)
    h.fail.add("stats:customer:1")
    c.touch("stats:customer:1", "a")
    await c.drain()
    shard = c.keyspace.shard(0)
    assert await c.redis.exists(shard.claimed_items("stats:customer:1")) == 1
    await c.query.purge_dead(["stats:customer:1"])
    assert await c.redis.exists(shard.claimed_items("stats:customer:1")) == 0
    h.fail.clear()
    c.touch("stats:customer:1", "b")
    assert [x.items for x in await c.drain()] == [("b",)]


async def test_a_batch_handler_gets_each_claim_with_its_own_items(start: Start) -> None:
    c, h = await start()
    c.touch_items([("bunch:1", "a"), ("bunch:2", "b"), ("bunch:1", "c")])
    c.touch("bunch:3")
    done = await c.drain()
    assert {x.key: x.items for x in done} == {"bunch:1": ("a", "c"), "bunch:2": ("b",),
                                               "bunch:3": ()}
    assert len(h.calls) == 1 and len(h.calls[0]) == 3


async def test_items_reach_refreshes_on_every_shard(start: Start) -> None:
    c, _ = await start(shards=4)
    pairs = [(f"stats:customer:{i}", f"o{i}") for i in range(20)]
    c.touch_items(pairs)
    done = await c.drain()
    assert sorted((x.key, x.items) for x in done) == sorted((k, (i,)) for k, i in pairs)


async def test_a_stale_ack_leaves_the_new_holders_items(redis_client: Any,
                                                        namespace: str) -> None:
    """A holder whose lease expired acks after the key was claimed again: its ack is
    refused, and the items of the new claim stay until that claim is acked."""
    scripts, space = Scripts(redis_client), KeySpace(namespace, 1)
    shard, rules = space.shard(0), {"r": 10}
    group = UpsertGroup("r", 0, 1000, ["k"], {"k": ["a"]}, 10)
    await scripts.upsert(shard, [group])
    _, [old] = await scripts.take(shard, node_id="n1", claim_lease_ms=1,
                                  limits=[("r", 10)], item_rules=rules)
    assert old.items == ("a",)
    assert await wait_until(lambda: scripts.recover(shard, ["r"], 10),
                            message="the 1 ms lease recovered") == 1
    await scripts.upsert(shard, [UpsertGroup("r", 0, 1000, ["k"], {"k": ["b"]}, 10)])
    _, [new] = await scripts.take(shard, node_id="n2", claim_lease_ms=5000,
                                  limits=[("r", 10)], item_rules=rules)
    assert new.items == ("a", "b")  # the lost claim's items, and the new ones
    assert await scripts.ack(shard, [("r", [("k", old.token)])], item_rules=rules) == ["k"]
    assert await redis_client.smembers(shard.claimed_items("k")) == {"a", "b"}
    assert await scripts.ack(shard, [("r", [("k", new.token)])], item_rules=rules) == []
    assert await redis_client.exists(shard.claimed_items("k")) == 0


async def test_an_expired_lease_gives_its_items_to_the_next_claim(start: Start) -> None:
    c, _ = await start()
    c.touch("stats:customer:1", "a")
    await c.flush()
    shard = c.keyspace.shard(0)
    scripts = Scripts(c.redis)
    await scripts.hasten(shard, ["customer"], 10)  # due now
    _, [lost] = await scripts.take(shard, node_id="dead", claim_lease_ms=1,
                                   limits=[("customer", 10)], item_rules={"customer": 5})
    assert lost.items == ("a",)
    c.touch("stats:customer:1", "b")
    done = await c.drain()  # recovers the expired claim, then runs it
    assert [(x.attempt, x.items) for x in done] == [(2, ("a", "b"))]


async def test_explain_counts_a_keys_pending_and_claimed_items(start: Start) -> None:
    c, h = await start(attempts=2)
    idle = await c.query.explain("stats:customer:1")
    assert idle["rule"]["items"] == {"max": 5}
    assert idle["items"]["pending"] == 0 and "0 items pending" in format_explain(idle)
    c.touch_items([("stats:customer:1", "secret-1"), ("stats:customer:1", "secret-2")])
    await c.flush()
    info = await c.query.explain("stats:customer:1")
    assert info["items"] == {"pending": 2, "pending_overflowed": False, "claimed": 0,
                             "claimed_overflowed": False,
                             "pending_items": ["secret-1", "secret-2"], "claimed_items": []}
    text = format_explain(info)
    assert "2 items pending" in text and "items: up to 5 a refresh" in text
    assert "secret-1" not in text  # the items themselves only in the JSON
    h.fail.add("stats:customer:1")
    await c.drain()  # both attempts fail: dead, its items held for a retry
    dead = await c.query.explain("stats:customer:1")
    assert dead["items"]["claimed_items"] == ["secret-1", "secret-2"]
    assert "2 items held by the current claim" in format_explain(dead)
    plain = await c.query.explain("plain:1")
    assert plain["items"] is None and "items " not in format_explain(plain)
    c.touch_items([("stats:customer:2", f"o{i}") for i in range(6)])  # one past max
    await c.flush()
    over = await c.query.explain("stats:customer:2")
    assert over["items"]["pending"] == 5 and over["items"]["pending_overflowed"]
    assert "5 items pending (overflowed: the next refresh is told so)" in format_explain(over)


def test_a_rules_fingerprint_changes_with_items_and_not_without(tmp_path: Path) -> None:
    def rule(extra: str) -> Any:
        path = tmp_path / "rules.yaml"
        path.write_text("rules:\n  - name: r\n    match: \"r:*\"\n"
                        f"    handler: builtins:print\n{extra}")
        return Config.from_yaml(path).rule("r")
    plain, items, more = rule(""), rule("    items: {max: 10}\n"), rule("    items: {max: 11}\n")
    assert len({fingerprint(plain), fingerprint(items), fingerprint(more)}) == 3
    assert fingerprint(plain) == fingerprint(rule(""))


@pytest.mark.parametrize(("text", "message"), [
    ("items: {max: 0}", "rules[0].items.max: must be a positive whole number"),
    ("items: {max: 100001}", "rules[0].items.max: must be at most 100000"),
    ("items: {size: 3}", "rules[0].items"),
    ("items: {}", "items is missing the required field 'max'"),
    ("items: 5", "rules[0].items"),
])
def test_a_bad_items_field_is_refused_at_load_with_file_line_and_field(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: r\n    match: \"r:*\"\n    handler: builtins:print\n"
                    f"    {text}\n")
    with pytest.raises(ConfigError) as caught:
        Config.from_yaml(path)
    assert message in str(caught.value)
    assert f"{path}:5" in str(caught.value)


def test_items_max_is_read_and_described(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: r\n    match: \"r:*\"\n    handler: builtins:print\n"
                    "    items: {max: 1000}\n")
    rule = Config.from_yaml(path).rule("r")
    assert rule.items is not None and rule.items.max == 1000
    assert "items: max 1000" in rule.describe()


async def test_claims_and_acks_of_a_rule_without_items_run_no_set_command(
        own_server: Any, namespace: str) -> None:
    """A rule without items pays nothing for items existing: its claim and ack calls
    carry no items section, and Redis runs no command on an items set for them, even
    in a call beside a rule that has items."""
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        scripts, shard = Scripts(client), KeySpace(namespace, 1).shard(0)
        await scripts.upsert(shard, [UpsertGroup("plain", 0, 1000, ["p1", "p2"])])
        await scripts.take(shard, node_id="n", claim_lease_ms=5000, limits=[("plain", 0)],
                           item_rules={"items": 5})  # loads the scripts
        before = await command_calls(client)
        _, claims = await scripts.take(shard, node_id="n", claim_lease_ms=5000,
                                       limits=[("plain", 10), ("items", 10)],
                                       item_rules={"items": 5})
        await scripts.ack(shard, [("plain", [(x.key, x.token) for x in claims])],
                          item_rules={"items"})
        after = await command_calls(client)
    finally:
        await client.aclose()
    assert sorted(x.key for x in claims) == ["p1", "p2"]
    ran = {name for name in after if after[name] != before.get(name, 0)}
    assert not ran & {"exists", "smembers", "rename", "sunionstore", "sadd", "scard", "del"}


async def command_calls(client: Any) -> dict[str, int]:
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def test_a_webhook_body_carries_the_items_and_the_overflow_flag(
        namespace: str, redis_url: str, rules_file: Any, receiver: Receiver) -> None:  # noqa: F811
    path = rules_file(f"""
        namespace: {namespace}
        defaults: {{window: 50ms, max_wait: 1s, absorb: 10ms}}
        rules:
          - name: customer
            match: "stats:customer:{{id}}"
            items: {{max: 2}}
            handler:
              http: {{url: "{receiver.url('/hook')}"}}
        """)
    async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as c:
        c.touch("stats:customer:1", "b")
        c.touch("stats:customer:1", "a")
        c.touch_items([("stats:customer:2", x) for x in "xyz"])
        await c.drain()
    bodies = [hit.json() for hit in receiver.hits]
    got = {b["key"]: (b["items"], b["items_overflowed"]) for b in bodies}
    assert got["stats:customer:1"] == (["a", "b"], False)
    assert got["stats:customer:2"][1] is True and len(got["stats:customer:2"][0]) == 2


async def test_a_transient_write_error_keeps_the_items_for_the_next_write(
        start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    c, _ = await start()
    scripts = c._run.scripts
    assert scripts is not None
    real = scripts.upsert_keys
    failures = [RedisConnectionError("injected")]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real(*args, **kwargs)

    monkeypatch.setattr(scripts, "upsert_keys", flaky)
    c.touch("stats:customer:1", "a")
    with pytest.raises(RedisUnreachableError):
        await c.flush()
    c.touch("stats:customer:1", "b")
    assert [x.items for x in await c.drain()] == [("a", "b")]
    assert c._run.absorber._item_count == 0


async def test_a_key_redis_cannot_touch_is_dropped_with_its_items_and_the_others_kept(
        start: Start) -> None:
    c, _ = await start()
    shard = c.keyspace.shard(0)
    await c.redis.hset(shard.meta, "stats:customer:1", "R|not a state")  # corrupted by hand
    c.touch_items([("stats:customer:1", "a"), ("stats:customer:2", "b")])
    await c.flush()
    assert [d["key"] for d in c.dropped_keys()] == ["stats:customer:1"]
    assert not await c.redis.exists(shard.items("stats:customer:1"))
    assert c._run.absorber._item_count == 0
    await c.redis.hdel(shard.meta, "stats:customer:1")
    assert [(x.key, x.items) for x in await c.drain()] == [("stats:customer:2", ("b",))]


async def test_the_waiting_touches_carry_items(start: Start) -> None:
    c, _ = await start()
    await c.touch_wait("stats:customer:1", "a")
    await c.touch_items_wait([("stats:customer:1", "b"), ("stats:customer:2", "c")])
    with pytest.raises(InvalidItemError):
        await c.touch_items_wait([("stats:customer:3", "d"), ("plain:1", "e")])
    done = await c.drain()
    assert sorted((x.key, x.items) for x in done) == [
        ("stats:customer:1", ("a", "b")), ("stats:customer:2", ("c",))]


def test_a_sync_coalescer_touches_with_items(namespace: str, redis_url: str,
                                             rules_file: Any) -> None:
    path = rules_file(RULES.format(ns=namespace, max=5, attempts=1, shards=1, lease="5s"),
                      HANDLERS)
    with SyncCoalescer.from_yaml(path, redis_url=redis_url) as s:
        s.touch("stats:customer:1", "a")
        s.touch_items([("stats:customer:1", "b")])
        s.touch_wait("stats:customer:2", "c")
        s.touch_items_wait([("stats:customer:2", "d")])
        with pytest.raises(InvalidItemError):
            s.touch("plain:1", "x")
        s.flush()
        shard = KeySpace(namespace, 1).shard(0)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            assert r.smembers(shard.items("stats:customer:1")) == {"a", "b"}
            assert r.smembers(shard.items("stats:customer:2")) == {"c", "d"}
        finally:
            r.close()


async def test_a_retry_whose_items_grew_past_max_is_capped_and_told_so(
        redis_client: Any, namespace: str) -> None:
    scripts, shard = Scripts(redis_client), KeySpace(namespace, 1).shard(0)
    rules = {"r": 3}

    async def touch(*items: str) -> None:
        await scripts.upsert(shard, [UpsertGroup("r", 0, 1000, ["k"], {"k": list(items)}, 3)])

    await touch("a", "b", "c")
    _, [first] = await scripts.take(shard, node_id="n", claim_lease_ms=1, limits=[("r", 5)],
                                    item_rules=rules)
    assert (first.items, first.overflowed) == (("a", "b", "c"), False)
    await wait_until(lambda: scripts.recover(shard, ["r"], 10),
                     message="the 1 ms lease recovered")  # the holder died
    await touch("d", "e")
    _, [again] = await scripts.take(shard, node_id="n", claim_lease_ms=5000,
                                    limits=[("r", 5)], item_rules=rules)
    assert again.overflowed and len(again.items) == 3
    assert set(again.items) < {"a", "b", "c", "d", "e"}
    assert await redis_client.scard(shard.claimed_items("k")) == 4  # three and the mark


async def test_an_adopted_rule_hands_its_claims_their_items(redis_client: Any,
                                                            namespace: str) -> None:
    """A rule the shard's leader lacks is claimed by adopt.lua: with its items too."""
    scripts, shard = Scripts(redis_client), KeySpace(namespace, 1).shard(0)
    await scripts.acquire(shard, node_id="L", lease_ms=60_000, mine="", rules="|other=f1|")
    await scripts.acquire(shard, node_id="C", lease_ms=60_000, mine="", rules="|r=f2|")
    await scripts.upsert(shard, [UpsertGroup("r", 0, 1000, ["k1", "k2"], {"k1": ["a"]}, 5)])
    batch = await scripts.adopt(shard, node_id="C",
                                claim_lease_ms=5_000, limits=[("r", 10)], item_rules={"r": 5})
    assert sorted((c.key, c.items) for c in batch.claims) == [("k1", ("a",)), ("k2", ())]
