"""End to end, in process: `Coalescer` nodes (worker=True) on real valkey-servers.

Each test loads rules whose handler records every claim it is called with (see
``e2e.Recorder``), touches keys, and checks what a user would: how many
refreshes ran, in which order, with which tokens and attempts, and that each one
started (server clock) after the touches it covers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from coalescer import BackpressureError, Claim, Coalescer, UnknownKeyError
from coalescer.store.keys import KeySpace, layout, node_leases, protocol_version
from tests.conftest import Start
from tests.helpers.e2e import Recorder, leader_node, recorder_rules, server_ms, settled
from tests.helpers.servers import ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
shards: {shards}
leader_lease: {leader_lease}
claim_lease: 1s
defaults:
  window: 100ms
  max_wait: 2s
  absorb: 10ms
  timeout: 5s
  retry: {{attempts: 3, backoff: 20ms, max_backoff: 50ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
{extra}"""



def rules_text(ns: str, *, shards: int = 1, leader_lease: str = "1s", extra: str = "") -> str:
    return RULES.format(ns=ns, shards=shards, leader_lease=leader_lease, extra=extra)


def slow_rule(timeout: str) -> str:
    """A second rule, "slow" (keys slow:ID), with a handler timeout of ``timeout``."""
    return f"""\
  - name: slow
    match: "slow:{{id}}"
    timeout: {timeout}
    handler: {{mod}}:refresh
"""


def setup(tmp_path: Path, namespace: str, text: str) -> tuple[Path, Recorder]:
    return recorder_rules(tmp_path, f"rec_{namespace}", text)


async def wait_settled(r: Any, namespace: str, shards: int = 1, timeout: float = 10.0) -> None:
    await wait_until(lambda: settled(r, namespace, shards), timeout=timeout,
                     message="every key refreshed and acked")


async def status_of(c: Coalescer) -> dict[str, Any]:
    return await c.query.status()


# -- lost update: no lost update -----------------------------------------------------------


async def test_burst_yields_one_refresh_after_the_last_touch(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    for _ in range(20):
        c.touch("item:7")
        await asyncio.sleep(0.005)
    await c.flush()
    before_last = await server_ms(redis_client)
    c.touch("item:7")
    await c.flush()
    await wait_settled(redis_client, namespace)

    assert len(rec.calls) == 1, rec.calls
    claim = rec.calls[0]
    assert isinstance(claim, Claim)
    assert (claim.key, claim.rule, claim.params, claim.attempt) == (
        "item:7", "item", {"id": "7"}, 1)
    assert isinstance(claim.token, int)
    assert claim.token >= 1
    # the claim covers the whole burst, up to the last touch
    assert claim.first_touch_ms <= before_last <= claim.last_touch_ms
    # trailing edge: due one window after the last touch, and started after that
    assert claim.due_ms == claim.last_touch_ms + 100
    assert rec.start_ms[0] >= claim.due_ms > claim.last_touch_ms


async def test_touch_during_refresh_causes_exactly_one_more(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    rec.clock = lambda: server_ms(redis_client)
    gate = rec.hold_first()
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("item:1")
    await c.flush()
    await wait_until(lambda: len(rec.calls) == 1, message="the first refresh running")

    during = await server_ms(redis_client)
    for _ in range(5):
        c.touch("item:1")
        await c.flush()
    last_touch = await server_ms(redis_client)
    status = await c.query.status()
    assert status["rules"]["item"]["in_flight"] == 1
    assert status["rules"]["item"]["pending"] == 0  # recorded on the running claim
    assert len(rec.calls) == 1  # not claimed twice while it runs
    gate.set()
    await wait_settled(redis_client, namespace)

    assert len(rec.calls) == 2, rec.calls
    first, second = rec.calls
    assert second.first_touch_ms >= during
    assert second.last_touch_ms <= last_touch
    assert rec.start_ms[1] >= second.due_ms >= second.last_touch_ms + 100
    assert second.token > first.token
    assert second.attempt == 1


# -- coalescing, with the max-wait cap -----------------------------------------------------


async def test_max_wait_caps_a_never_ending_burst(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    extra = """\
  - name: hot
    match: "hot:{id}"
    window: 300ms
    max_wait: 500ms
    handler: {mod}:refresh
"""
    path, rec = setup(tmp_path, namespace, rules_text(namespace, extra=extra))
    c = await start(path, redis_url=redis_url, node_id="n1")
    first = time.monotonic()
    last = first
    while last - first < 1.5:
        c.touch("hot:1")
        last = time.monotonic()
        await asyncio.sleep(0.02)
    await c.flush()
    await wait_settled(redis_client, namespace)

    burst, cap = last - first, 0.5
    n = len(rec.calls)
    print(f"\nG2: a {burst:.2f}s burst with max_wait {cap}s gave {n} refreshes")
    assert math.floor(burst / cap) <= n <= math.ceil(burst / cap) + 1
    for claim in rec.calls:  # the cap is never pushed back
        assert claim.due_ms - claim.first_touch_ms <= 500, claim
    tokens = [claim.token for claim in rec.calls]
    assert tokens == sorted(set(tokens))


# -- exclusion: exclusion, fencing tokens --------------------------------------------------


async def test_no_two_refreshes_of_a_key_overlap_across_nodes(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    extra = """\
  - name: busy
    match: "busy:{id}"
    window: 30ms
    max_wait: 60ms
    handler: {mod}:refresh
"""
    path, rec = setup(tmp_path, namespace, rules_text(namespace, shards=2, extra=extra))
    rec.clock = lambda: server_ms(redis_client)

    async def slow(claim: Claim) -> None:
        await asyncio.sleep(0.04)

    rec.hook = slow
    a = await start(path, redis_url=redis_url, node_id="A")
    b = await start(path, redis_url=redis_url, node_id="B")
    keys = [f"busy:{i}" for i in range(6)]
    for round_ in range(50):
        node = a if round_ % 2 else b
        for key in keys:
            node.touch(key)
        await asyncio.sleep(0.01)
    await a.flush()
    await b.flush()
    before_final = await server_ms(redis_client)
    for key in keys:
        a.touch(key)
    await a.flush()
    await wait_settled(redis_client, namespace, shards=2)

    for key in keys:
        claims = rec.of(key)
        assert len(claims) >= 2, (key, claims)
        assert rec.max_active[key] == 1, f"{key} ran {rec.max_active[key]} times at once"
        tokens = [c.token for c in claims]
        assert tokens == sorted(set(tokens)), f"tokens of {key} do not grow: {tokens}"
        final = claims[-1]  # the final touch was refreshed, after it
        assert final.last_touch_ms >= before_final
        # due = min(last + window, first + max_wait): the last touch itself when it came
        # exactly max_wait after the first
        assert rec.started(key)[-1] >= final.due_ms >= final.last_touch_ms


# -- retries, timeouts, dead letters -------------------------------------------------------


async def test_failing_handler_is_retried_then_dead_lettered_then_requeued(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    failing = {"item:bad", "item:worse"}

    async def maybe_fail(claim: Claim) -> None:
        if claim.key in failing:
            raise RuntimeError(f"boom on {claim.key}")

    rec.hook = maybe_fail
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("item:bad")
    await c.flush()

    async def dead() -> int:
        return int((await c.query.status())["rules"]["item"]["dead"])

    await wait_until(lambda: _eq(dead(), 1), message="item:bad dead-lettered")
    assert [claim.attempt for claim in rec.of("item:bad")] == [1, 2, 3]
    status = await c.query.status()
    (letter,) = status["dead_letters"]
    assert letter["key"] == "item:bad"
    assert letter["attempts"] == 3
    assert "boom on item:bad" in letter["error"]

    # `retry` brings it back, with fresh attempts
    failing.discard("item:bad")
    assert (await c.query.retry_dead(["item:bad"])).done == 1
    await wait_settled(redis_client, namespace)
    assert [claim.attempt for claim in rec.of("item:bad")] == [1, 2, 3, 1]
    assert rec.succeeded[-1].key == "item:bad"
    assert await dead() == 0

    # a new touch of a dead key re-queues it too
    c.touch("item:worse")
    await c.flush()
    await wait_until(lambda: _eq(dead(), 1), message="item:worse dead-lettered")
    failing.discard("item:worse")
    c.touch("item:worse")
    await c.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.attempt for claim in rec.of("item:worse")] == [1, 2, 3, 1]
    assert rec.succeeded[-1].key == "item:worse"
    tokens = [claim.token for claim in rec.of("item:worse")]
    assert tokens == sorted(set(tokens))


async def _eq(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


async def test_handler_past_its_timeout_fails_and_is_retried(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace, extra=slow_rule("200ms")))

    async def hang_first(claim: Claim) -> None:
        if claim.attempt == 1:
            await asyncio.sleep(60)

    rec.hook = hang_first
    c = await start(path, redis_url=redis_url, node_id="n1")
    c.touch("slow:1")
    await c.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.attempt for claim in rec.of("slow:1")] == [1, 2]
    assert [claim.attempt for claim in rec.succeeded] == [2]
    sample = c.metrics.registry.get_sample_value
    assert sample("coalescer_refreshes_total", {"rule": "slow", "outcome": "timeout"}) == 1
    assert sample("coalescer_refreshes_total", {"rule": "slow", "outcome": "success"}) == 1
    assert (await c.query.status())["rules"]["slow"]["dead"] == 0


async def test_a_refresh_past_its_timeout_times_out_alone_among_those_claimed_with_it(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace, extra=slow_rule("300ms")))

    async def hang_first_try_of_one(claim: Claim) -> None:
        if claim.key == "slow:3" and claim.attempt == 1:
            await asyncio.sleep(60)
        elif claim.attempt == 1:
            await asyncio.sleep(0.05)

    rec.hook = hang_first_try_of_one
    c = await start(path, redis_url=redis_url, node_id="n1", worker=False)
    for i in range(6):
        c.touch(f"slow:{i}")
    await c.flush()  # all six are due together: one claim call takes them
    w = await start(path, redis_url=redis_url, node_id="n2")
    await wait_settled(redis_client, namespace)
    assert sorted(claim.key for claim in rec.succeeded) == sorted(f"slow:{i}" for i in range(6))
    assert [claim.attempt for claim in rec.of("slow:3")] == [1, 2]
    sample = w.metrics.registry.get_sample_value
    assert sample("coalescer_refreshes_total", {"rule": "slow", "outcome": "timeout"}) == 1
    assert sample("coalescer_refreshes_total", {"rule": "slow", "outcome": "success"}) == 6


# -- bounded buffer, unknown keys ----------------------------------------------------------


async def test_backpressure_when_redis_is_unreachable(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, start: Start) -> None:
    path, _ = setup(tmp_path, namespace, rules_text(namespace))
    c = await start(path, redis_url=own_server.url, worker=False, max_buffered=5)
    own_server.stop()
    for i in range(5):
        c.touch(f"item:{i}")
    c.touch("item:0")  # a key already buffered costs nothing
    with pytest.raises(BackpressureError):
        c.touch("item:5")
    # nothing accepted was lost: once Redis is back, the five are written
    own_server.start()
    await asyncio.wait_for(c.flush(), 20)
    due = KeySpace(namespace, 1).shard(0).due("item")
    assert own_server.client().zcard(due) == 5
    c.touch("item:5")  # room again
    await c.flush()
    assert own_server.client().zcard(due) == 6


async def test_unknown_key_is_refused_naming_it(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, _ = setup(tmp_path, namespace, rules_text(namespace))
    c = await start(path, redis_url=redis_url, worker=False)
    with pytest.raises(UnknownKeyError) as err:
        c.touch("nope:1")
    assert err.value.key == "nope:1"
    assert "nope:1" in str(err.value)
    await c.flush()
    # nothing was written: only the namespace's shard layout, which the writer read at
    # start, and the touch protocol's version, which it wrote there
    assert sorted(await redis_client.keys(f"{namespace}:*")) == sorted(
        [layout(namespace), protocol_version(namespace)])


# -- leadership: leadership ----------------------------------------------------------------


async def test_one_leader_and_fast_takeover_after_close(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    sk = KeySpace(namespace, 1).shard(0)
    a = await start(path, redis_url=redis_url, node_id="A")
    await wait_until(lambda: a.leads() == [0], message="A leads")
    b = await start(path, redis_url=redis_url, node_id="B")
    await wait_until(lambda: _is_not_none(redis_client.zscore(sk.nodes, "B")),
                     message="B standing by")
    status = await b.query.status()
    assert status["shards"][0]["leader"] == "A"
    assert b.leads() == []

    b.touch("item:1")  # any node takes touches; the leader claims them
    await b.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.key for claim in rec.calls] == ["item:1"]

    await a.close()
    # the lease was released, not left to expire
    assert leader_node(await redis_client.get(sk.leader)) in (None, "B")
    await wait_until(lambda: b.leads() == [0], message="B takes over")
    assert (await b.query.status())["shards"][0]["leader"] == "B"
    b.touch("item:2")
    await b.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.key for claim in rec.calls] == ["item:1", "item:2"]


async def _is_not_none(value: Awaitable[Any]) -> bool:
    return await value is not None


async def test_node_that_loses_its_lease_stops_claiming(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    sk = KeySpace(namespace, 1).shard(0)
    a = await start(path, redis_url=redis_url, node_id="A")
    b = await start(path, redis_url=redis_url, node_id="B")
    await wait_until(lambda: a.leads() or b.leads(), message="a leader")

    # another node, whose node lease lives for a minute, takes the shard
    leases = node_leases(namespace)
    await redis_client.zadd(leases, {"intruder": await server_ms(redis_client) + 60_000})
    await redis_client.set(sk.leader, "999999|intruder")
    a.touch("item:1")
    await a.flush()
    await wait_until(lambda: not a.leads() and not b.leads(), message="both step down")
    due = await redis_client.zscore(sk.due("item"), "item:1")
    assert due is not None
    # well past its due time (and past a poller's longest sleep), nobody claimed it
    await wait_until(lambda: _past(redis_client, due + 600), message="server clock past due")
    assert rec.calls == []
    assert await redis_client.zscore(sk.due("item"), "item:1") == due
    assert (await a.query.status())["shards"][0]["leader"] == "intruder"

    await redis_client.zadd(leases, {"intruder": 0})  # its lease ends: a node takes over
    await wait_settled(redis_client, namespace)
    assert [claim.key for claim in rec.calls] == ["item:1"]
    assert (await a.query.status())["shards"][0]["leader"] in ("A", "B")


async def _past(r: Any, ms: float) -> bool:
    return await server_ms(r) > ms


async def test_three_shards_two_nodes(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace, shards=3))
    a = await start(path, redis_url=redis_url, node_id="A")
    b = await start(path, redis_url=redis_url, node_id="B")

    async def every_shard_led() -> bool:
        leaders = [s["leader"] for s in (await a.query.status())["shards"]]
        return len(leaders) == 3 and all(node in ("A", "B") for node in leaders)

    await wait_until(every_shard_led, message="a leader on every shard")
    await wait_until(lambda: a.leads() and b.leads(), timeout=10,
                     message="shards spread over both nodes")
    assert sorted(a.leads() + b.leads()) == [0, 1, 2]

    keys = [f"item:{i}" for i in range(30)]
    space = KeySpace(namespace, 3)
    assert {space.shard_of(k) for k in keys} == {0, 1, 2}
    for i, key in enumerate(keys):
        (a if i % 2 else b).touch(key)
    await a.flush()
    await b.flush()
    await wait_settled(redis_client, namespace, shards=3)
    assert sorted(claim.key for claim in rec.calls) == sorted(keys)


# -- event-driven, cheap when idle, survives Redis going away ------------------------------


@pytest.mark.slow  # some 7-10 s: with the long scenarios, out of the quick run
async def test_idle_node_costs_under_half_a_command_a_second(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, start: Start) -> None:
    # leader_lease 3s (the default): an idle leader's claim, which renews the lease,
    # comes every three quarters of it (2.25 s); no health-check PINGs, and the rules
    # registry read once a minute.
    path, _ = setup(tmp_path, namespace, rules_text(namespace, leader_lease="3s"))
    c = await start(path, redis_url=own_server.url, node_id="idle")
    await wait_until(lambda: c.leads() == [0], message="the node leads")
    observer = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True,
                                            single_connection_client=True)
    try:
        await _past_start_up(observer)
        window = 6.5  # under three renewal periods (2.25 s)
        sent, evalsha, seconds = await _count_commands(observer, own_server.url, window)
    finally:
        await observer.aclose()
    print(f"\nidle node: {sent} commands in {seconds:.1f}s = {sent / seconds:.2f}/s "
          f"(EVALSHA per INFO commandstats: {evalsha})")
    assert sent >= 1  # it is alive and renewing
    assert sent <= 3  # 0.44 a second; a claim every 1.2 s would make 5 or 6
    assert evalsha <= 3


async def _scripts_run(observer: Any) -> int:
    stats = await observer.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def _past_start_up(observer: Any) -> None:
    """Wait out a new node's one-off start-up calls (it reads the rules registry once,
    half a second after it first counts the live nodes): two more script calls from
    now are either that read and a renewal, or two renewals, well after it."""
    before = await _scripts_run(observer)

    async def two_more() -> bool:
        return await _scripts_run(observer) >= before + 2

    await wait_until(two_more, timeout=10, interval=0.1, message="two more script calls")


async def _count_commands(observer: Any, url: str, window: float) -> tuple[int, int, float]:
    """Commands sent by clients other than ``observer`` over ``window`` of server time.

    INFO commandstats also counts the commands Lua scripts call (each claim is one
    EVALSHA but a dozen calls), so the node's own commands are counted with MONITOR,
    which tells a client's commands from a script's; commandstats gives EVALSHA.
    """
    me = (await observer.client_info())["addr"].rsplit(":", 1)[1]
    monitor_client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        async with monitor_client.monitor() as monitor:
            stats0 = await observer.info("commandstats")
            t0 = (await server_ms(observer)) / 1000
            end = t0 + window
            sent = 0

            async def consume() -> None:
                nonlocal sent
                while True:
                    cmd = await monitor.next_command()
                    if cmd["time"] > end:
                        return
                    if cmd["time"] > t0 and cmd["client_type"] != "lua" \
                            and cmd["client_port"] != me:
                        sent += 1

            reader = asyncio.create_task(consume())
            await wait_until(lambda: _past(observer, end * 1000), timeout=window + 5,
                             interval=0.05, message="the measuring window")
            await observer.ping()  # a command after the window ends the reader
            await asyncio.wait_for(reader, 5)
            stats1 = await observer.info("commandstats")
    finally:
        await monitor_client.aclose()
    evalsha = (stats1.get("cmdstat_evalsha", {}).get("calls", 0)
               - stats0.get("cmdstat_evalsha", {}).get("calls", 0))
    return sent, evalsha, window


async def test_touch_wakes_a_sleeping_poller(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    extra = """\
  - name: short
    match: "short:{id}"
    window: 200ms
    handler: {mod}:refresh
"""
    # leader_lease 3s: an idle poller sleeps a whole second between claims
    path, rec = setup(tmp_path, namespace, rules_text(namespace, leader_lease="3s",
                                                      extra=extra))
    rec.clock = lambda: server_ms(redis_client)
    sk = KeySpace(namespace, 1).shard(0)
    c = await start(path, redis_url=redis_url, node_id="n1")
    await wait_until(lambda: c.leads() == [0], message="the node leads")

    async def planned_wake() -> int | None:
        """When the idle poller plans to wake next, if that is far enough ahead."""
        planned, now = await redis_client.get(sk.next_wake), await server_ms(redis_client)
        return int(planned) if planned and int(planned) - now >= 500 else None

    planned = await wait_until(planned_wake, message="the poller asleep for a while")
    c.touch("short:1")
    await c.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.key for claim in rec.calls] == ["short:1"]
    # it was woken: the refresh started before the poller's planned wake-up
    assert rec.start_ms[0] < planned
    assert rec.start_ms[0] >= rec.calls[0].due_ms


async def test_short_window_key_is_not_stuck_behind_a_long_one(
        tmp_path: Path, namespace: str, redis_url: str, redis_client: Any,
        start: Start) -> None:
    extra = """\
  - name: short
    match: "short:{id}"
    window: 100ms
    handler: {mod}:refresh
  - name: long
    match: "long:{id}"
    window: 1500ms
    handler: {mod}:refresh
"""
    path, rec = setup(tmp_path, namespace, rules_text(namespace, leader_lease="3s",
                                                      extra=extra))
    rec.clock = lambda: server_ms(redis_client)
    c = await start(path, redis_url=redis_url, node_id="n1")
    await wait_until(lambda: c.leads() == [0], message="the node leads")
    c.touch("long:1")
    await c.flush()
    c.touch("short:1")
    await c.flush()
    await wait_settled(redis_client, namespace)
    assert [claim.key for claim in rec.calls] == ["short:1", "long:1"]
    long_claim = rec.calls[1]
    assert rec.start_ms[0] < long_claim.due_ms  # did not wait for the long one's due time
    assert rec.start_ms[1] >= long_claim.due_ms  # and the long one was not claimed early


async def test_poller_survives_a_redis_restart(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, start: Start) -> None:
    path, rec = setup(tmp_path, namespace, rules_text(namespace))
    c = await start(path, redis_url=own_server.url, node_id="n1")
    r = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        c.touch("item:1")
        await c.flush()
        await wait_until(lambda: [x.key for x in rec.succeeded] == ["item:1"])

        own_server.stop()
        c.touch("item:2")  # buffered while Redis is away
        own_server.start()
        await wait_until(lambda: "item:2" in [x.key for x in rec.succeeded], timeout=20,
                         message="item:2, touched while Redis was down, refreshed")
        c.touch("item:3")
        await c.flush()
        await wait_until(lambda: "item:3" in [x.key for x in rec.succeeded], timeout=20,
                         message="item:3, touched after the restart, refreshed")
        await wait_settled(r, namespace)
        assert sorted(x.key for x in rec.succeeded) == ["item:1", "item:2", "item:3"]
        assert c.leads() == [0]
    finally:
        await r.aclose()


async def test_a_dropped_wake_subscription_strands_nothing(
        tmp_path: Path, namespace: str, own_server: ValkeyProcess, start: Start) -> None:
    """event-driven: the wake channel's connection is killed; touches are still refreshed, and the
    node subscribes again (the known bug: a dropped subscription left work piling up)."""
    path, rec = setup(tmp_path, namespace, rules_text(namespace, leader_lease="3s"))
    c = await start(path, redis_url=own_server.url, node_id="n1")
    r = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    channel = KeySpace(namespace, 1).shard(0).wake_channel

    async def subscribers() -> int:
        return int(dict(await r.pubsub_numsub(channel))[channel])

    try:
        await wait_until(lambda: c.leads() == [0], message="the node leads")
        await wait_until(subscribers, message="the node subscribed to its wake channel")
        assert await r.client_kill_filter(_type="pubsub") >= 1
        c.touch("item:1")
        await c.flush()
        await wait_until(lambda: [x.key for x in rec.succeeded] == ["item:1"],
                         message="a touch made while unsubscribed is refreshed")
        await wait_until(subscribers, message="the node subscribed again")
        c.touch("item:2")
        await c.flush()
        await wait_until(lambda: [x.key for x in rec.succeeded] == ["item:1", "item:2"])
    finally:
        await r.aclose()
