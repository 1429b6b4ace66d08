"""Stream sources: entries of a Redis Stream become touches, acknowledged once in Redis.

The rules-file part is checked without a server; everything else runs real
coalescer nodes (in process) on real valkey-servers, writing entries with XADD
as an application would, and checks what a user would: which keys were
refreshed and how often, what the stream's group shows as pending and lag, what
`coalescer status` reports.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio

from coalescer import Coalescer
from coalescer.config.patterns import KeyPattern
from coalescer.config.rules import Config
from coalescer.config.templates import KeyTemplate
from coalescer.errors import ConfigError
from coalescer.query.source_status import add_sources, format_sources
from coalescer.query.status import format_status
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.servers import ValkeyProcess, wait_until

# -- the rules file ---------------------------------------------------------------------

BASE = """\
rules:
  - name: customer
    match: "stats:customer:{id}"
    handler: builtins:repr
  - name: org
    match: "stats:org:*"
    handler: builtins:repr
"""


def load(sources: str) -> Config:
    return Config.from_string(BASE + sources, source="rules.yaml")


def test_a_source_gets_its_defaults() -> None:
    config = load("""\
sources:
  - name: order-events
    stream: "app:order-events"
    key: "stats:customer:{customer_id}"
""")
    (source,) = config.sources
    assert (source.name, source.stream, source.group, source.start) == (
        "order-events", "app:order-events", "", "new")  # "": derived from the namespace
    assert source.key.fields == ("customer_id",)
    assert source.line == 9
    assert source.key.fill({"customer_id": "42"}) == "stats:customer:42"


def test_no_sources_is_an_empty_tuple() -> None:
    assert load("").sources == ()
    assert load("sources: []\n").sources == ()
    assert load("sources:\n").sources == ()


@pytest.mark.parametrize(("block", "line", "field", "words"), [
    ("  - {name: a, stream: s, key: 'stats:org:{o}', shard: 1}", 9, "sources[0].shard",
     "unknown field 'shard' in a source"),
    ("  - {name: a, stream: s, key: 'stats:org:{o}', start: latest}", 9, "sources[0].start",
     "start must be 'new'"),
    ("  - {name: a, stream: s, key: 'stats:org:{}'}", 9, "sources[0].key", "empty braces"),
    ("  - {name: a, stream: s, key: 'stats:org:{o'}", 9, "sources[0].key", "unbalanced '{'"),
    ("  - {name: a, stream: s, key: 'stats:org:o}'}", 9, "sources[0].key", "unbalanced '}'"),
    ("  - {name: a, stream: s, key: 'stats:org:{o}'}\n  - {name: a, stream: t, key: 'x{o}'}",
     10, "sources[1].name", "duplicate source name 'a' (first used on line 9)"),
    ("  - {name: a, key: 'stats:org:{o}'}", 9, "sources[0].stream",
     "missing the required field 'stream'"),
    ("  - {name: a, stream: s}", 9, "sources[0].key", "missing the required field 'key'"),
    ("  - {name: 'a b', stream: s, key: 'stats:org:{o}'}", 9, "sources[0].name",
     "may only use letters"),
    ("  - {name: a, stream: '', key: 'stats:org:{o}'}", 9, "sources[0].stream",
     "must be a non-empty string"),
    ("  - {name: a, stream: s, key: 'stats:user:{o}'}", 9, "sources[0].key",
     "can never match a rule"),
    ("  - {name: a, stream: s, key: 'stats:customer:{a}:{b}'}", 9, "sources[0].key",
     "can never match a rule"),
    ("  name: a", 9, "sources", "must be a list"),
])
def test_bad_sources_name_file_line_and_field(block: str, line: int, field: str,
                                              words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load("sources:\n" + block + "\n")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", line, field)
    assert words in err.message
    assert "\n" not in str(err)


@pytest.mark.parametrize(("template", "pattern", "can"), [
    ("stats:customer:{id}", "stats:customer:{id}", True),
    ("stats:{kind}", "stats:customer:{id}", True),  # kind = "customer:1"
    ("stats:{a}:{b}", "stats:customer:{id}", True),
    ("stats:customer:{a}:{b}", "stats:customer:{id}", False),  # a capture has no ':'
    ("stats:customer:", "stats:customer:{id}", False),  # a capture is not empty
    ("stats:customer:all", "stats:customer:{id}", True),
    ("stats:user:{id}", "stats:customer:{id}", False),
    ("{anything}", "stats:customer:{id}", True),
    ("stats:org:{a}:{b}", "stats:org:*", True),
    ("x:{a}", "*", True),
    ("report", "rep*t", True),
    ("report", "rep*x", False),
])
def test_a_template_can_match_a_pattern(template: str, pattern: str, can: bool) -> None:
    assert KeyTemplate.compile(template).could_match(KeyPattern.compile(pattern)) is can


# -- on a real server -------------------------------------------------------------------

RULES = """\
namespace: {ns}
{settings}rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: {{mod}}:refresh
sources:
  - name: orders
    stream: "{ns}-app:orders"
    key: "stats:customer:{{customer_id}}"
{extra}"""

FAST = """\
claim_lease: 1s
defaults:
  window: 100ms
  absorb: 10ms
"""


def rules_text(ns: str, *, settings: str = FAST, extra: str = "") -> str:
    return RULES.format(ns=ns, settings=settings, extra=extra)


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[Any]:
    """nodes(rules_path, redis_url, **options) -> a started Coalescer, closed at teardown."""
    async with AsyncExitStack() as stack:
        async def make(path: Path, url: str, **options: Any) -> Coalescer:
            options.setdefault("grace", 2.0)
            c = Coalescer.from_yaml(path, redis_url=url, **options)
            await stack.enter_async_context(c)
            return c

        yield make


def setup(tmp_path: Path, namespace: str, text: str) -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"rec_{namespace}", text)


def group_of(stream: str, source: str | None = None) -> str:
    """The group a source of ``stream`` reads in by default: ``coalescer.NAMESPACE.SOURCE``
    (these tests' streams are named NAMESPACE-app:SOURCE)."""
    namespace, _, name = stream.partition("-app:")
    return f"coalescer.{namespace}.{source or name}"


async def group_info(r: Any, stream: str, group: str | None = None) -> dict[str, Any] | None:
    group = group or group_of(stream)
    try:
        groups = await r.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    return next((g for g in groups if g["name"] == group), None)


async def refreshed(rec: Recorder, key: str, times: int = 1) -> bool:
    return len(rec.of(key)) >= times


async def source_status(c: Coalescer, name: str = "orders") -> dict[str, Any]:
    status = await c.query.status()
    entry: dict[str, Any] = status["sources"][name]
    return entry


def entries_counted(c: Coalescer, outcome: str, source: str = "orders") -> float:
    value = c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": source, "outcome": outcome})
    return value or 0.0


async def test_entries_refresh_each_customer_once_per_burst(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    # default rules settings: window 2s, concurrency 16, claim_lease 5s
    path, rec = setup(tmp_path, namespace, rules_text(namespace, settings=""))
    stream = f"{namespace}-app:orders"
    assert not await redis_client.exists(stream)
    c = await nodes(path, redis_url, node_id="node-a")
    await wait_until(lambda: group_info(redis_client, stream), message="the group")
    for n in range(30):
        await redis_client.xadd(stream, {"customer_id": str(n % 3), "order": str(n)})
    await wait_until(lambda: all(rec.of(f"stats:customer:{n}") for n in range(3)),
                     timeout=15, message="every customer refreshed")
    await wait_until(lambda: entries_counted(c, "accepted") == 30)
    assert sorted(call.key for call in rec.calls) == [f"stats:customer:{n}" for n in range(3)]
    group = await group_info(redis_client, stream)
    assert group is not None and (group["pending"], group["lag"]) == (0, 0)
    consumers = await redis_client.xinfo_consumers(stream, group_of(stream))
    assert [entry["name"] for entry in consumers] == ["node-a"]
    assert await source_status(c) == {"stream": stream, "group": group_of(stream), "lag": 0,
                                      "pending": 0, "rejected": 0, "unread": False}


async def test_start_new_skips_earlier_entries_and_all_reads_them(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    extra = f"""\
  - name: history
    stream: "{namespace}-app:history"
    start: all
    key: "stats:customer:{{customer_id}}"
"""
    path, rec = setup(tmp_path, namespace, rules_text(namespace, extra=extra))
    await redis_client.xadd(f"{namespace}-app:orders", {"customer_id": "old-order"})
    await redis_client.xadd(f"{namespace}-app:history", {"customer_id": "old-history"})
    c = await nodes(path, redis_url)
    await wait_until(lambda: refreshed(rec, "stats:customer:old-history"))
    await wait_until(lambda: group_info(redis_client, f"{namespace}-app:orders"))
    await redis_client.xadd(f"{namespace}-app:orders", {"customer_id": "new-order"})
    await wait_until(lambda: refreshed(rec, "stats:customer:new-order"))
    assert rec.of("stats:customer:old-order") == []
    assert (await c.query.explain("stats:customer:old-order"))["state"] == "idle"
    assert entries_counted(c, "accepted", "history") == 1
    assert entries_counted(c, "accepted", "orders") == 1


async def test_bad_entries_are_acknowledged_counted_and_never_block(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any, *,
        caplog: pytest.LogCaptureFixture) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    raw = redis.asyncio.Redis.from_url(redis_url)  # bytes, as any producer may write
    try:
        c = await nodes(path, redis_url)
        await wait_until(lambda: group_info(redis_client, stream))
        caplog.set_level(logging.WARNING, logger="coalescer.sources.streams")
        bad = [
            await raw.xadd(stream, {b"order": b"1"}),  # no customer_id
            await raw.xadd(stream, {b"customer_id": b""}),  # a key no rule matches
            await raw.xadd(stream, {b"customer_id": b"7:admin"}),  # would span segments
            await raw.xadd(stream, {b"customer_id": b"\xff\xfe"}),  # not UTF-8
            await raw.xadd(stream, {b"customer_id": b"x\x00y"}),  # unstorable: a NUL
            await raw.xadd(stream, {b"customer_id": b"9" * 2000}),  # too long for a key
            await raw.xadd(stream, {b"customer_id": b"\xff" * (20 << 20)}),  # never decoded
        ]
        await raw.xadd(stream, {b"customer_id": b"7"})
    finally:
        await raw.aclose()
    await wait_until(lambda: refreshed(rec, "stats:customer:7"))
    await wait_until(lambda: entries_counted(c, "rejected") == 7)
    assert entries_counted(c, "accepted") == 1
    assert [call.key for call in rec.calls] == ["stats:customer:7"]
    assert await source_status(c) == {"stream": stream, "group": group_of(stream), "lag": 0,
                                      "pending": 0, "rejected": 7, "unread": False}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for entry_id, why in zip(bad, ["no field 'customer_id'", "no rule matches key",
                                   "holds ':' (at index 1)", "not UTF-8", "NUL character",
                                   "2000 bytes long, over the limit",
                                   f"{20 << 20} bytes long, over the limit"],
                             strict=True):
        assert f"entry {entry_id.decode()} of stream {stream!r} rejected" in logged
        assert why in logged


async def test_a_dead_consumers_entries_are_claimed_after_claim_lease(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    await redis_client.xgroup_create(stream, group_of(stream), id="$", mkstream=True)
    entry_id = await redis_client.xadd(stream, {"customer_id": "orphan"})
    # a node that read the entry and died before acknowledging it
    read = await redis_client.xreadgroup(group_of(stream), "dead-node", {stream: ">"}, count=10)
    assert read[0][1][0][0] == entry_id
    c = await nodes(path, redis_url, node_id="survivor")
    await wait_until(lambda: refreshed(rec, "stats:customer:orphan"), timeout=15)
    group = await group_info(redis_client, stream)
    assert group is not None and group["pending"] == 0
    assert entries_counted(c, "accepted") == 1
    assert rec.of("stats:customer:orphan")[0].attempt == 1


async def test_a_restarted_node_reads_its_own_unacknowledged_entries_first(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    # claim_lease long: only the node itself, back under the same id, can take them now
    settings = "claim_lease: 1h\ndefaults: {window: 100ms, absorb: 10ms}\n"
    path, rec = setup(tmp_path, namespace, rules_text(namespace, settings=settings))
    stream = f"{namespace}-app:orders"
    await redis_client.xgroup_create(stream, group_of(stream), id="$", mkstream=True)
    await redis_client.xadd(stream, {"customer_id": "mine"})
    await redis_client.xreadgroup(group_of(stream), "node-a", {stream: ">"}, count=10)
    await nodes(path, redis_url, node_id="node-a")
    await wait_until(lambda: refreshed(rec, "stats:customer:mine"))
    group = await group_info(redis_client, stream)
    assert group is not None and group["pending"] == 0


async def test_status_shows_lag_pending_and_rejected(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    reader = await nodes(path, redis_url, worker=False)  # a write-path process reads none
    assert await source_status(reader) == {"stream": stream, "group": group_of(stream),
                                           "lag": None, "pending": None, "rejected": 0,
                                           "unread": True}
    await redis_client.xgroup_create(stream, group_of(stream), id="$", mkstream=True)
    for customer in ("1", "2", "3"):
        await redis_client.xadd(stream, {"customer_id": customer})
    await redis_client.xadd(stream, {"other": "field"})
    await redis_client.xreadgroup(group_of(stream), "dead-node", {stream: ">"}, count=1)
    status = await reader.query.status()
    assert status["sources"]["orders"] == {"stream": stream, "group": group_of(stream), "lag": 3,
                                           "pending": 1, "rejected": 0,
                                           "unread": True}  # no worker runs yet
    text = format_status(status, now_ms=0)
    assert f"orders{' ' * 18} {3:>8} {1:>8} {0:>9}  {stream} ({group_of(stream)})" in text
    worker = await nodes(path, redis_url)
    await wait_until(lambda: all(rec.of(f"stats:customer:{n}") for n in "123"), timeout=15)
    await wait_until(lambda: source_status(reader), message="status")
    assert await wait_until(
        lambda: _equals(source_status(reader), {"stream": stream, "group": group_of(stream),
                                                "lag": 0, "pending": 0, "rejected": 1,
                                                "unread": False}))
    assert entries_counted(worker, "rejected") == 1


async def sources_of(c: Coalescer) -> dict[str, Any]:
    """The sources part of the status (the whole status is read on a single server)."""
    status: dict[str, Any] = {}
    await add_sources(c.redis, c.config, status)
    return status["sources"]  # type: ignore[no-any-return]


async def _equals(aw: Any, expected: Any) -> bool:
    return bool(await aw == expected)


def test_human_status_lists_no_sources_when_there_are_none() -> None:
    assert format_sources({"sources": {}}) == []
    assert format_sources({}) == []


async def test_a_redis_restart_does_not_stop_consumption(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        await nodes(path, own_server.url)
        await wait_until(lambda: group_info(client, stream))
        await client.xadd(stream, {"customer_id": "before"})
        await wait_until(lambda: refreshed(rec, "stats:customer:before"))
        own_server.restart()  # no persistence: the stream and its group are gone
        await client.aclose()
        client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
        await wait_until(lambda: group_info(client, stream), timeout=15,
                         message="the group created again")
        await client.xadd(stream, {"customer_id": "after"})
        await wait_until(lambda: refreshed(rec, "stats:customer:after"), timeout=15)
    finally:
        await client.aclose()


async def test_a_deleted_stream_or_group_is_created_again(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream))
    await redis_client.delete(stream)
    await redis_client.xadd(stream, {"customer_id": "after-delete"})
    await wait_until(lambda: refreshed(rec, "stats:customer:after-delete"), timeout=15)
    await redis_client.xgroup_destroy(stream, group_of(stream))
    await redis_client.xadd(stream, {"customer_id": "after-destroy"})
    await wait_until(lambda: refreshed(rec, "stats:customer:after-destroy"), timeout=15)
    group = await group_info(redis_client, stream)
    assert group is not None and group["pending"] == 0


async def test_two_nodes_share_a_stream_and_each_entry_counts_once(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    stream = f"{namespace}-app:orders"
    a = await nodes(path, redis_url, node_id="a")
    b = await nodes(path, redis_url, node_id="b")
    await wait_until(lambda: group_info(redis_client, stream))
    for n in range(200):
        await redis_client.xadd(stream, {"customer_id": str(n)})
    await wait_until(lambda: len({call.key for call in rec.calls}) == 200, timeout=15)
    await wait_until(lambda: entries_counted(a, "accepted") + entries_counted(b, "accepted")
                     == 200)
    group = await group_info(redis_client, stream)
    assert group is not None and (group["pending"], group["lag"]) == (0, 0)


async def test_on_a_cluster_the_stream_has_its_own_slot(
        tmp_path: Path, namespace: str, cluster: Any, nodes: Any) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace, settings=FAST + "shards: 3\n"))
    stream = f"{namespace}-app:orders"
    client = redis.asyncio.RedisCluster.from_url(cluster.urls[0], decode_responses=True)
    try:
        c = await nodes(path, cluster.urls[1])
        await wait_until(lambda: group_info(client, stream), timeout=15)
        for n in range(20):
            await client.xadd(stream, {"customer_id": str(n)})
        await client.xadd(stream, {"customer_id": "no:rule"})
        await wait_until(lambda: len({call.key for call in rec.calls}) == 20, timeout=15)
        expected = {"orders": {"stream": stream, "group": group_of(stream), "lag": 0, "pending": 0,
                               "rejected": 1}}
        await wait_until(lambda: _equals(sources_of(c), expected))
    finally:
        await client.aclose()


# -- items ------------------------------------------------------------------------------

ITEM_BASE = """\
rules:
  - name: customer
    match: "stats:customer:{id}"
    handler: builtins:repr
    items: {max: 100}
  - name: org
    match: "stats:org:*"
    handler: builtins:repr
"""


def test_a_source_may_fill_an_item_from_its_entries() -> None:
    config = Config.from_string(ITEM_BASE + """\
sources:
  - {name: a, stream: s, key: "stats:customer:{customer_id}", item: "order:{order_id}"}
""", source="rules.yaml")
    (source,) = config.sources
    assert source.item is not None and source.item.fields == ("order_id",)
    assert source.item.fill({"order_id": "7"}) == "order:7"
    assert Config.from_string(ITEM_BASE + "sources:\n  - {name: a, stream: s, key: "
                              "'stats:customer:{c}'}\n").sources[0].item is None


@pytest.mark.parametrize(("block", "words"), [
    ("  - {name: a, stream: s, key: 'stats:org:{o}', item: '{order}'}",
     "can never match a rule with items"),
    ("  - {name: a, stream: s, key: 'stats:customer:{c}', item: 'x{'}", "unbalanced '{' in item"),
    ("  - {name: a, stream: s, key: 'stats:customer:{c}', item: ''}", "must be a non-empty"),
])
def test_a_bad_item_of_a_source_names_file_line_and_field(block: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_string(ITEM_BASE + "sources:\n" + block + "\n", source="rules.yaml")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", 10, "sources[0].item")
    assert words in err.message


async def test_entries_with_an_item_deliver_it_and_bad_items_are_rejected(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any, nodes: Any) -> None:
    text = rules_text(namespace, extra='    item: "order:{order}"\n').replace(
        "    handler: {mod}:refresh\n", "    handler: {mod}:refresh\n    items: {max: 10}\n", 1)
    path, rec = setup(tmp_path, namespace, text)
    stream = f"{namespace}-app:orders"
    c = await nodes(path, redis_url)
    await wait_until(lambda: group_info(redis_client, stream))
    for order in ("1", "2", "1"):
        await redis_client.xadd(stream, {"customer_id": "7", "order": order})
    await redis_client.xadd(stream, {"customer_id": "8"})  # no order: rejected
    await redis_client.xadd(stream, {"customer_id": "9", "order": "x" * 300})  # too long
    await wait_until(lambda: refreshed(rec, "stats:customer:7"))
    await wait_until(lambda: entries_counted(c, "rejected") == 2)
    assert entries_counted(c, "accepted") == 3
    assert [(call.key, call.items) for call in rec.calls] == [
        ("stats:customer:7", ("order:1", "order:2"))]


def test_an_entrys_item_is_refused_with_the_reason() -> None:
    from coalescer.common.metrics import Metrics
    from coalescer.config.sources import StreamSource
    from coalescer.sources.streams import SourceLoop

    config = Config.from_string(ITEM_BASE + """\
sources:
  - {name: a, stream: s, key: "stats:{kind}:{id}", item: "order:{order}"}
""", source="rules.yaml")
    (source,) = config.sources
    assert isinstance(source, StreamSource)

    def nothing(*_: Any) -> None:
        return None

    loop = SourceLoop(source, None, config=config, node_id="n", touch_many=nothing,
                      flush=nothing, metrics=Metrics(), touch_items=nothing)
    key = "stats:customer:7"
    assert loop.item_of({b"order": b"1"}, key) == ("order:1", "")
    assert loop.item_of({b"order": b"a:b"}, key) == ("order:a:b", "")  # ':' is fine here
    cases = [({}, "no field 'order' (for its item)"),
             (None, "no field 'order'"),
             ({b"order": b"\xff"}, "field 'order' is not UTF-8 text"),
             ({b"order": b"9" * 300}, "300 bytes long, over the limit of 256 for an item"),
             ({b"order": b"x\x00y"}, "NUL character")]
    for fields, why in cases:
        item, reason = loop.item_of(fields, key)
        assert item is None and why in reason, (fields, reason)
    item, reason = loop.item_of({b"order": b"1"}, "stats:org:7")
    assert item is None and "the rule of key 'stats:org:7' takes no items" in reason
