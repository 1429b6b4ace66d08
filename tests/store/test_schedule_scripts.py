"""Touches with a time of their own (``at``/``delay``) through the upsert script, on a
real server: every due time is read back from Redis and follows the server clock."""

from __future__ import annotations

import pytest
import redis.asyncio

from coalescer.store import key_states as states
from coalescer.store.script_types import CancelGroup, History, UpsertGroup
from tests.store.test_scripts import LONG, RULE, Shard

Redis = redis.asyncio.Redis
FAR = 30 * 86_400_000  # ms: thirty days


@pytest.fixture
def shard(redis_client: Redis, namespace: str) -> Shard:
    return Shard(redis_client, namespace)


async def timed(shard: Shard, times: dict[str, str], *, window: int = LONG,
                max_wait: int = 10 * LONG, plain: tuple[str, ...] = ()) -> None:
    """One upsert of the keys of ``times`` (each with its time) and the ``plain`` ones."""
    keys = [*times, *plain]
    n = await shard.scripts.upsert(shard.keys, [
        UpsertGroup(RULE, window, max_wait, keys, schedules=times)])
    assert n == len(keys)


async def scheduled(shard: Shard, key: str) -> bool:
    state = await shard.state(key)
    pending = states.pending(state) if state else None
    assert pending is not None, f"{key} is not pending: {state}"
    return pending.scheduled


async def test_a_timed_touch_is_due_at_its_time_and_the_latest_schedule_wins(
        shard: Shard) -> None:
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    assert await shard.due("k") == now + FAR
    await timed(shard, {"k": f"a{now + LONG}"})  # earlier: the due set learns it too
    assert await shard.due("k") == now + LONG
    assert int(await shard.r.zscore(shard.keys.due(RULE), "k")) == now + LONG
    before = await shard.now()
    await timed(shard, {"k": "d5000"})  # a delay counts from the server's clock
    after = await shard.now()
    due = await shard.due("k")
    assert due is not None and before + 5000 <= due <= after + 5000
    assert await scheduled(shard, "k")


async def test_a_plain_touch_after_a_schedule_replaces_it_with_a_new_burst(
        shard: Shard) -> None:
    now = await shard.now()
    await timed(shard, {"far": f"a{now + FAR}", "near": f"a{now + 100}"})
    await shard.touch("far", "near", window=LONG)
    for key in ("far", "near"):  # earlier for one, later for the other
        _, first, last, _ = await shard.fields(key)
        assert first == last
        assert await shard.due(key) == int(first) + LONG
        assert not await scheduled(shard, key)
    # the burst it started goes on as usual: the later touches keep its first touch
    _, first, _, _ = await shard.fields("far")
    await shard.touch("far", window=LONG)
    assert (await shard.fields("far"))[1] == first


async def test_a_schedule_then_a_plain_touch_in_one_write_is_the_plain_touch(
        shard: Shard) -> None:
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}+"}, window=LONG)
    _, first, _, _ = await shard.fields("k")
    assert await shard.due("k") == int(first) + LONG
    assert not await scheduled(shard, "k")


async def test_max_wait_does_not_cap_a_schedule(shard: Shard) -> None:
    await shard.touch("k", window=10, max_wait=20)  # a burst capped at 20 ms
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"}, window=10, max_wait=20)
    assert await shard.due("k") == now + FAR


async def test_a_time_in_the_past_is_due_at_once(shard: Shard) -> None:
    await shard.lead()
    before = await shard.now()
    await timed(shard, {"k": "a1000"})
    after = await shard.now()
    due = await shard.due("k")
    assert due is not None and before <= due <= after
    claim = await shard.claim_one("k")
    assert claim.due_ms == due


async def test_a_scheduled_key_is_not_claimed_before_its_time(shard: Shard) -> None:
    await shard.lead()
    now = await shard.now()
    await timed(shard, {"k": f"a{now + 300}"})
    await shard.touch("other", window=0)
    assert [c.key for c in (await shard.claim()).claims] == ["other"]
    await shard.after(now + 300)
    assert (await shard.claim_one("k")).due_ms == now + 300


async def test_cancel_drops_a_schedule_and_history_shows_it(shard: Shard) -> None:
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    found = await shard.scripts.cancel(shard.keys, [CancelGroup(RULE, ["k"])],
                                       History("canceller", 100))
    assert found.states == {"k": "pending"}
    assert await shard.state("k") is None
    assert await shard.r.zscore(shard.keys.due(RULE), "k") is None
    entries = [f for _, f in await shard.r.xrange(shard.keys.history)]
    assert [(f["key"], f["outcome"], f["due"]) for f in entries] == [
        ("k", "cancelled", str(now + FAR))]


async def test_a_schedule_during_a_run_makes_the_next_run_due_at_it(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0)
    claim = await shard.claim_one("k")
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    await shard.touch("other", window=0)  # a plain touch of another key changes nothing
    assert (await shard.fields("k"))[6] == f"S{now + FAR}"
    assert await shard.ack("k", claim.token) == []
    assert await shard.due("k") == now + FAR
    assert await scheduled(shard, "k")  # a plain touch after the run replaces it
    await shard.touch("k", window=LONG)
    _, first, _, _ = await shard.fields("k")
    assert await shard.due("k") == int(first) + LONG


async def test_a_plain_touch_during_a_run_after_a_schedule_replaces_it(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0)
    claim = await shard.claim_one("k")
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    await shard.touch("k", window=LONG)
    fields = await shard.fields("k")
    assert fields[6] == str(int(fields[7]) + LONG)  # RDUE: a new burst from RFIRST
    assert await shard.ack("k", claim.token) == []
    assert await shard.due("k") == int(fields[7]) + LONG
    assert not await scheduled(shard, "k")


async def test_a_schedule_brings_a_dead_key_back(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0)
    claim = await shard.claim_one("k")
    await shard.fail("k", claim.token, attempts=1)
    assert await shard.dead("k") is not None
    now = await shard.now()
    await timed(shard, {"k": f"a{now + LONG}"})
    assert await shard.dead("k") is None
    assert await shard.due("k") == now + LONG


async def test_a_retry_after_a_failed_run_waits_for_a_schedule_made_during_it(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0)
    claim = await shard.claim_one("k")
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    retried, died, _ = await shard.fail("k", claim.token, attempts=3, delay=10)
    assert (retried, died) == (1, 0)
    assert await shard.due("k") == now + FAR  # not the retry's 10 ms backoff
    assert await scheduled(shard, "k")
    assert (await shard.fields("k"))[3] == "1"  # the attempt made is kept


async def test_a_lapsed_claim_with_a_schedule_made_during_it_is_due_at_the_schedule(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0)
    await shard.claim_one("k", lease=1)
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    await shard.after(now + 5)  # the 1 ms lease has lapsed
    assert await shard.scripts.recover(shard.keys, [RULE], 100, [3]) == 1
    assert await shard.due("k") == now + FAR  # not at once
    assert await scheduled(shard, "k")


async def test_a_key_scheduled_a_month_ahead_keeps_a_state_as_short_as_a_plain_one(
        shard: Shard) -> None:
    now = await shard.now()
    await timed(shard, {"k": f"a{now + FAR}"})
    state = await shard.state("k")
    assert state is not None and state.startswith("S") and len(state) <= 17, state
    found = states.pending(state)
    assert found is not None and (found.due_ms, found.scheduled) == (now + FAR, True)
