"""The Lua steps (coalescer/store/lua/*.lua) through ``Scripts``, on a real server.

Every due time, lease and token is read back from Redis; times are the server's
(``TIME``), never the client's.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis.asyncio

from coalescer.errors import NotLeaderError, ScriptError
from coalescer.store import key_states as states
from coalescer.store.connection import connect
from coalescer.store.keys import ShardKeys, node_leases
from coalescer.store.script_calls import script_source
from coalescer.store.script_types import (
    CancelGroup,
    ClaimBatch,
    ClaimedKey,
    Failure,
    History,
    UpsertGroup,
)
from coalescer.store.scripts import Scripts
from tests.helpers.servers import ValkeyProcess, wait_until

RULE = "r"
LONG = 60_000  # ms: a window no test waits for
Redis = redis.asyncio.Redis


class Shard:
    """One shard of a fresh namespace, its scripts, and a leader lease held by node n1."""

    def __init__(self, client: Redis, namespace: str) -> None:
        self.r = client
        self.keys = ShardKeys(namespace, 0)
        self.scripts = Scripts(client)
        self.leader = ""

    async def lead(self) -> str:
        state = await self.scripts.acquire(self.keys, node_id="n1", lease_ms=30_000, mine="")
        assert state.granted
        self.leader = state.holder
        return self.leader

    async def now(self) -> int:
        sec, usec = await self.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def after(self, ms: int) -> int:
        """Poll the server clock until it reads later than ``ms``; returns that time."""
        async def later() -> int:
            now = await self.now()
            return now if now > ms else 0
        return int(await wait_until(later, message=f"server clock past {ms}"))

    async def touch(self, *keys: str, window: int = 0, max_wait: int = 10 * LONG,
                    rule: str = RULE) -> None:
        n = await self.scripts.upsert(self.keys, [UpsertGroup(rule, window, max_wait, keys)])
        assert n == len(keys)

    async def claim(self, limit: int = 100, *, lease: int = LONG, leader: str | None = None,
                    limits: list[tuple[str, int]] | None = None) -> ClaimBatch:
        return await self.scripts.claim(
            self.keys, leader=self.leader if leader is None else leader, node_id="n1",
            claim_lease_ms=lease, sleep_cap_ms=1000,
            limits=limits or [(RULE, limit)])

    async def claim_one(self, key: str, **kw: Any) -> ClaimedKey:
        batch = await self.claim(**kw)
        assert [c.key for c in batch.claims] == [key]
        return batch.claims[0]

    async def ack(self, key: str, token: int, rule: str = RULE) -> list[str]:
        return await self.scripts.ack(self.keys, [(rule, [(key, token)])])

    async def fail(self, key: str, token: int, *, attempts: int = 3, delay: int = 0,
                   error: str = "boom") -> tuple[int, int, list[str]]:
        """(retried, how many died, stale keys); the dead keys are checked to be ``key``."""
        retried, dead, stale = await self.scripts.fail(
            self.keys, [(RULE, attempts, [Failure(key, token, delay, error)])])
        assert dead in ([], [key])
        return retried, len(dead), stale

    async def state(self, key: str) -> str | None:
        value = await self.r.hget(self.keys.meta, key)
        return None if value is None else str(value)

    async def fields(self, key: str) -> list[str]:
        """The key's state; a pending key's without its due time (see ``due``)."""
        state = await self.state(key)
        assert state is not None, f"{key} has no state"
        p = states.pending(state)
        if p is not None:
            return ["P", str(p.first_ms), str(p.last_ms), str(p.attempts)]
        return state.split("|")

    async def due(self, key: str, rule: str = RULE) -> int | None:
        """When a pending key is due: the due time in meta, of which its score in the
        due set is a lower bound (a re-touch moves only the former)."""
        score = await self.r.zscore(self.keys.due(rule), key)
        if score is None:
            return None
        state = await self.state(key)
        pending = states.pending(state) if state else None
        assert pending is not None, f"{key} is due but {state}"
        due = pending.due_ms
        assert int(score) <= due, f"{key}: score {score} is after its due time {due}"
        return due

    async def inflight(self, key: str, rule: str = RULE) -> int | None:
        score = await self.r.zscore(self.keys.inflight(rule), key)
        return None if score is None else int(score)

    async def dead(self, key: str, rule: str = RULE) -> int | None:
        score = await self.r.zscore(self.keys.dead(rule), key)
        return None if score is None else int(score)


@pytest.fixture
def shard(redis_client: Redis, namespace: str) -> Shard:
    return Shard(redis_client, namespace)


# -- upsert: due times ---------------------------------------------------------------------


async def test_an_upsert_makes_a_few_redis_calls_per_rule_not_one_per_key(
        own_server: ValkeyProcess, namespace: str) -> None:
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        shard = Shard(client, namespace)
        await shard.touch("warm")  # the script is loaded
        await shard.touch(*(f"k{i}" for i in range(1000)))  # pending keys, re-touched below
        await client.config_resetstat()
        fresh = [f"new{i}" for i in range(1000)]
        await shard.touch(*fresh, *(f"k{i}" for i in range(1000)), window=60_000)
        stats = await client.info("commandstats")
        calls = {name: v["calls"] for name, v in stats.items() if name != "cmdstat_evalsha"}
        assert stats["cmdstat_evalsha"]["calls"] == 1
        # HMGET, HSET, ZADD, the HGET of the rule's fair order (none here), and the
        # script's TIME, GET/SET/PUBLISH of the wake-up
        assert sum(calls.values()) <= 9, calls
        assert await client.zcard(shard.keys.due(RULE)) == 2001
    finally:
        await client.aclose()


async def test_new_key_is_due_at_server_time_plus_window(shard: Shard) -> None:
    before = await shard.now()
    await shard.touch("k", window=LONG)
    after = await shard.now()
    due = await shard.due("k")
    assert due is not None and before + LONG <= due <= after + LONG
    kind, first, last, attempts = await shard.fields("k")
    assert (kind, attempts) == ("P", "0")
    assert int(first) == int(last) == due - LONG


async def test_due_time_follows_the_server_clock_not_a_skewed_client_clock(
        shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
    before = await shard.now()
    await shard.touch("k", window=2000)
    after = await shard.now()
    due = await shard.due("k")
    assert due is not None and before + 2000 <= due <= after + 2000
    assert due < (time.time() * 1000) - 3000 * 1000  # nowhere near the skewed clock


async def test_touches_push_due_to_min_of_t_plus_window_and_first_plus_max_wait(
        shard: Shard) -> None:
    window, max_wait = LONG, LONG + 50
    await shard.touch("k", window=window, max_wait=max_wait)
    _, first, _, _ = await shard.fields("k")
    first_ms = int(first)

    # A touch soon after: the trailing edge moves to t + W (still under the cap).
    await shard.touch("k", window=window, max_wait=max_wait)
    _, first2, last2, _ = await shard.fields("k")
    assert int(first2) == first_ms  # the burst keeps its first touch
    assert await shard.due("k") == min(int(last2) + window, first_ms + max_wait)

    # Once t + W passes first + M, the cap holds, and more touches never push past it.
    await shard.after(first_ms + 50)
    for _ in range(5):
        await shard.touch("k", window=window, max_wait=max_wait)
        assert await shard.due("k") == first_ms + max_wait
    _, first3, last3, _ = await shard.fields("k")
    assert int(first3) == first_ms and int(last3) > first_ms + 50


async def test_a_retouch_moves_the_due_time_in_meta_and_claim_rescores_an_early_key(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k", window=0, max_wait=LONG)
    score = int(await shard.r.zscore(shard.keys.due(RULE), "k"))
    await shard.touch("k", window=200, max_wait=LONG)  # the due time moves later...
    assert int(await shard.r.zscore(shard.keys.due(RULE), "k")) == score  # ...in meta only
    due = await shard.due("k")
    assert due is not None and due > score
    assert (await shard.claim()).claims == []  # found early by its score: not claimed
    assert int(await shard.r.zscore(shard.keys.due(RULE), "k")) == due  # re-scored
    await shard.after(due)
    claimed = await shard.claim_one("k")
    assert claimed.due_ms == due


async def test_batch_upsert_schedules_several_rules_in_one_call(shard: Shard) -> None:
    before = await shard.now()
    groups = [UpsertGroup("a", 1000, 5000, ["a:1", "a:2"]),
              UpsertGroup("b", 3000, 5000, ["b:1"])]
    assert await shard.scripts.upsert(shard.keys, groups) == 3
    after = await shard.now()
    for key, rule, window in (("a:1", "a", 1000), ("a:2", "a", 1000), ("b:1", "b", 3000)):
        due = await shard.due(key, rule)
        assert due is not None and before + window <= due <= after + window


async def test_any_key_text_survives_the_batch_encoding(shard: Shard) -> None:
    """Keys travel NUL-joined in one argument: '|', spaces, unicode and '' come back whole."""
    keys = ["", "a|b|c", "with space", "ключ:42", "x" * 300]
    await shard.lead()
    assert await shard.scripts.upsert(shard.keys, [UpsertGroup(RULE, 0, 1000, keys)]) == 5
    assert sorted(await shard.r.zrange(shard.keys.due(RULE), 0, -1)) == sorted(keys)
    batch = await shard.claim(limit=10)
    assert sorted(c.key for c in batch.claims) == sorted(keys)


async def test_any_key_text_survives_the_ack_encoding(shard: Shard) -> None:
    """Claims travel to ack NUL-joined as TOKEN|START|MS|KEY: a key holding '|' and digits
    is finished, and its start and duration reach the history whole."""
    keys = ["", "7|8|9|x", "a|b", "ключ:42", "line\nbreak", "100%|%z"]
    await shard.lead()
    await shard.touch(*keys)
    claims = (await shard.claim(limit=10)).claims
    items = [(c.key, c.token, 1_700_000_000_123, 4_321) for c in claims]
    assert await shard.scripts.ack(shard.keys, [(RULE, items)], History("n1", 100)) == []
    assert await shard.r.hlen(shard.keys.meta) == 0
    recorded = [f for _, f in await shard.r.xrange(shard.keys.history)]
    assert sorted((f["key"], f["start"], f["ms"], f["outcome"]) for f in recorded) == sorted(
        (k, "1700000000123", "4321", "success") for k in keys)


async def test_an_ack_whose_claims_do_not_parse_is_refused_whole(shard: Shard) -> None:
    """An ack argument that holds fewer claims than it announces fails the call (naming
    both counts) and finishes nothing: the claims stay leased, to be acked again."""
    await shard.lead()
    await shard.touch("k:1", "k:2")
    claims = (await shard.claim(limit=10)).claims
    ack = shard.r.register_script(script_source("ack"))
    keys = [shard.keys.meta, shard.keys.next_wake, shard.keys.history,
            shard.keys.due(RULE), shard.keys.inflight(RULE)]
    one = f"{claims[0].token}|0|0|{claims[0].key}"
    with pytest.raises(redis.exceptions.ResponseError, match="2 claims announced, 1 given"):
        await ack(keys=keys, args=[shard.keys.wake_channel, "n1", 0, shard.keys.traces_prefix,
                                   RULE, 2, one])
    assert await shard.r.zcard(shard.keys.inflight(RULE)) == 2
    assert await shard.scripts.ack(shard.keys, [(RULE, [(c.key, c.token) for c in claims])]) == []


# -- claim ---------------------------------------------------------------------------------


async def test_a_due_key_whose_state_was_corrupted_is_claimed_and_blocks_no_other(
        shard: Shard) -> None:
    """A meta value that does not read (written by something else) must not fail the
    shard's claim call: the key is claimed as touched now, and its ack heals it."""
    await shard.lead()
    await shard.touch("a", "bad-new", "bad-old", "b")
    await shard.r.hset(shard.keys.meta, mapping={"bad-new": "zz|x", "bad-old": "P|x|1|0|1"})
    before = await shard.now()
    batch = await shard.claim(limit=10)
    assert sorted(c.key for c in batch.claims) == ["a", "b", "bad-new", "bad-old"]
    for c in batch.claims:
        if c.key.startswith("bad"):
            assert c.first_ms == c.last_ms == c.due_ms >= before and c.attempt == 1
        assert await shard.ack(c.key, c.token) == []
    assert await shard.r.hlen(shard.keys.meta) == 0


async def test_states_an_older_version_wrote_are_claimed_and_acked(shard: Shard) -> None:
    """Values of the older forms (pending "P|...", running without the node, running
    without a re-arm part) are claimed with their times, and acked; a touch recorded in
    an older running value is re-armed."""
    await shard.lead()
    now = await shard.now()
    await shard.touch("old-pending")
    await shard.r.hset(shard.keys.meta, "old-pending", f"P|{now - 50}|{now - 20}|1|{now - 10}")
    claimed = await shard.claim_one("old-pending")
    assert (claimed.first_ms, claimed.last_ms, claimed.attempt, claimed.due_ms) == (
        now - 50, now - 20, 2, now - 10)
    assert await shard.ack(claimed.key, claimed.token) == []
    await shard.touch("no-node", "oldest")
    no_node, oldest = sorted((await shard.claim(limit=10)).claims, key=lambda c: c.key)
    await shard.r.hset(shard.keys.meta, mapping={
        "no-node": f"R|{no_node.token}|1|1|1|1|{now + LONG}|{now}|{now}",
        "oldest": f"R|{oldest.token}|1|1|1|1"})
    assert await shard.ack("no-node", no_node.token) == []
    assert await shard.ack("oldest", oldest.token) == []
    assert await shard.due("no-node") == now + LONG
    assert await shard.r.hexists(shard.keys.meta, "oldest") == 0


async def test_claim_refuses_a_caller_that_does_not_hold_the_lease(shard: Shard) -> None:
    leader = await shard.lead()
    await shard.touch("k")
    epoch = int(leader.split("|")[0])
    for wrong in (f"{epoch + 1}|n1", f"{epoch}|n2", ""):
        with pytest.raises(NotLeaderError):
            await shard.claim(leader=wrong)
    assert await shard.due("k") is not None
    assert await shard.r.zcard(shard.keys.inflight(RULE)) == 0
    assert (await shard.fields("k"))[0] == "P"
    assert (await shard.claim_one("k")).attempt == 1  # the real leader still can


async def test_a_long_window_key_is_not_claimed_by_an_immediate_claim(shard: Shard) -> None:
    """The ZPOPMIN trap: the earliest entry is popped whether or not it is due."""
    await shard.lead()
    await shard.touch("long", window=LONG)
    assert (await shard.claim()).claims == []
    await shard.touch("short", window=0)
    claimed = await shard.claim_one("short")
    assert claimed.key == "short"
    assert await shard.due("long") is not None
    assert await shard.inflight("long") is None
    batch = await shard.claim()
    assert batch.claims == []
    assert batch.next_due_ms == await shard.due("long")


async def test_claims_come_lowest_due_first_bounded_by_each_rules_limit(shard: Shard) -> None:
    await shard.lead()
    # One call, one server time: windows 40..0 ms give k0 the latest due, k4 the earliest.
    groups = [UpsertGroup(RULE, 40 - 10 * i, LONG, [f"k{i}"]) for i in range(5)]
    groups.append(UpsertGroup("other", 0, LONG, ["o1", "o2", "o3"]))
    await shard.scripts.upsert(shard.keys, groups)
    latest = await shard.due("k0")
    assert latest is not None
    await shard.after(latest)

    first = await shard.claim(limits=[(RULE, 3), ("other", 1)])
    assert [(c.rule_index, c.key) for c in first.claims] == [
        (0, "k4"), (0, "k3"), (0, "k2"), (1, "o1")]
    assert [c.due_ms for c in first.claims[:3]] == sorted(c.due_ms for c in first.claims[:3])
    second = await shard.claim(limits=[(RULE, 3), ("other", 0)])
    assert [c.key for c in second.claims] == ["k1", "k0"]
    assert await shard.r.zrange(shard.keys.due("other"), 0, -1) == ["o2", "o3"]


async def test_fencing_tokens_strictly_increase_per_key(shard: Shard) -> None:
    await shard.lead()
    tokens = []
    for _ in range(4):
        await shard.touch("k", "noise")
        batch = await shard.claim()
        for c in batch.claims:
            assert await shard.ack(c.key, c.token) == []
        tokens.append(next(c.token for c in batch.claims if c.key == "k"))
    assert tokens == sorted(set(tokens)) and len(tokens) == 4


# -- touches during a run, ack -------------------------------------------------------------


async def test_a_touch_during_a_run_rearms_exactly_one_more_claim_on_ack(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    claim = await shard.claim_one("k")

    before = await shard.now()
    await shard.touch("k", window=5)
    after = await shard.now()
    fields = await shard.fields("k")
    assert fields[0] == "R" and int(fields[1]) == claim.token
    rdue = int(fields[6])
    assert before + 5 <= rdue <= after + 5
    # Still in flight: not claimable again until it is acked, however long we look.
    await shard.after(rdue)
    assert (await shard.claim()).claims == []

    assert await shard.ack("k", claim.token) == []
    assert await shard.due("k") == rdue  # the touch made during the run
    assert await shard.inflight("k") is None
    again = await shard.claim_one("k")
    assert again.token > claim.token and again.attempt == 1 and again.due_ms == rdue
    assert (await shard.claim()).claims == []
    assert await shard.ack("k", again.token) == []
    assert (await shard.claim()).claims == []


async def test_ack_without_a_touch_removes_all_state(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    claim = await shard.claim_one("k")
    assert await shard.inflight("k") is not None
    assert await shard.ack("k", claim.token) == []
    assert await shard.r.hexists(shard.keys.meta, "k") == 0
    assert await shard.due("k") is None and await shard.inflight("k") is None
    assert (await shard.claim()).claims == []


async def test_one_ack_of_thousands_of_claims_finishes_each_once(shard: Shard) -> None:
    # More keys than one batched removal takes (4,000), some touched while they ran,
    # and one key given twice: acked once, the second copy reported stale.
    await shard.lead()
    keys = [f"k{i}" for i in range(4500)]
    for start in range(0, len(keys), 1000):
        await shard.touch(*keys[start:start + 1000])
    claims = []
    while len(claims) < len(keys):
        claims += (await shard.claim(1000)).claims
    rearmed = keys[::500]
    await shard.touch(*rearmed, window=LONG)
    items = [(c.key, c.token) for c in claims] + [(claims[1].key, claims[1].token)]
    stale = await shard.scripts.ack(shard.keys, [(RULE, items)])
    assert stale == [claims[1].key]
    assert await shard.r.zcard(shard.keys.inflight(RULE)) == 0
    assert await shard.r.hlen(shard.keys.meta) == len(rearmed)
    assert await shard.r.zcard(shard.keys.due(RULE)) == len(rearmed)
    assert all([await shard.due(k) for k in rearmed])


async def test_stale_token_is_refused_by_ack_renew_and_fail(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    old = await shard.claim_one("k", lease=1)  # the holder "dies": its lease runs out
    await shard.after(old.due_ms + 1)

    async def recovered() -> int:
        return await shard.scripts.recover(shard.keys, [RULE], 100)
    assert await wait_until(recovered) == 1
    new = await shard.claim_one("k")
    assert new.token > old.token and new.attempt == 2
    state, lease = await shard.state("k"), await shard.inflight("k")

    assert await shard.ack("k", old.token) == ["k"]
    assert await shard.scripts.renew(shard.keys, LONG * 10, [(RULE, [("k", old.token)])]) == ["k"]
    assert await shard.fail("k", old.token, delay=0) == (0, 0, ["k"])
    assert await shard.state("k") == state
    assert await shard.inflight("k") == lease
    assert await shard.due("k") is None and await shard.dead("k") is None

    # The current holder's token still works.
    assert await shard.scripts.renew(shard.keys, LONG * 10, [(RULE, [("k", new.token)])]) == []
    renewed = await shard.inflight("k")
    assert renewed is not None and lease is not None and renewed > lease
    assert await shard.ack("k", new.token) == []
    assert await shard.state("k") is None


# -- fail: retries and dead letters --------------------------------------------------------


async def test_fail_retries_after_the_delay_then_dead_letters_the_last_attempt(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    first = await shard.claim_one("k")
    first_touch = first.first_ms

    before = await shard.now()
    assert await shard.fail("k", first.token, delay=LONG) == (1, 0, [])
    after = await shard.now()
    due = await shard.due("k")
    assert due is not None and before + LONG <= due <= after + LONG
    assert await shard.fields("k") == ["P", str(first_touch), str(first.last_ms), "1"]
    assert (await shard.claim()).claims == []  # not before its delay

    # A retry due now (its delay cut short by hand): attempt 2, then 3 (the last of 3).
    state = await shard.fields("k")
    await shard.r.hset(shard.keys.meta, "k", "|".join([*state, str(before)]))
    await shard.r.zadd(shard.keys.due(RULE), {"k": before})
    second = await shard.claim_one("k")
    assert (second.attempt, second.first_ms) == (2, first_touch)
    assert await shard.fail("k", second.token, delay=0) == (1, 0, [])
    third = await shard.claim_one("k")
    assert third.attempt == 3 and third.token > second.token > first.token

    died_at = await shard.now()
    assert await shard.fail("k", third.token, error="boom: a|b") == (0, 1, [])
    when = await shard.dead("k")
    assert when is not None and when >= died_at
    assert await shard.state("k") == f"D|{first_touch}|{first.last_ms}|3|boom: a|b"
    assert await shard.due("k") is None and await shard.inflight("k") is None
    assert (await shard.claim()).claims == []


async def test_a_touch_during_the_last_attempt_requeues_instead_of_dead_lettering(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    claim = await shard.claim_one("k")
    await shard.touch("k", window=0)  # arrives while the only attempt runs
    rdue = int((await shard.fields("k"))[6])
    assert await shard.fail("k", claim.token, attempts=1) == (0, 0, [])
    assert await shard.dead("k") is None
    assert await shard.due("k") == rdue
    assert (await shard.fields("k"))[0] == "P"
    again = await shard.claim_one("k")
    assert again.attempt == 1  # a new burst: fresh attempts


async def dead_letter(shard: Shard, key: str) -> None:
    await shard.touch(key)
    claim = await shard.claim_one(key)
    assert await shard.fail(key, claim.token, attempts=1) == (0, 1, [])


async def test_a_new_touch_of_a_dead_key_requeues_it_with_fresh_attempts(shard: Shard) -> None:
    await shard.lead()
    await dead_letter(shard, "k")
    before = await shard.now()
    await shard.touch("k", window=3)
    after = await shard.now()
    assert await shard.dead("k") is None
    due = await shard.due("k")
    assert due is not None and before + 3 <= due <= after + 3
    assert (await shard.fields("k"))[0::3] == ["P", "0"]
    await shard.after(due)
    assert (await shard.claim_one("k")).attempt == 1


# -- cancel --------------------------------------------------------------------------------


async def test_cancel_drops_pending_refreshes_and_re_arms_and_leaves_every_other_state(
        shard: Shard) -> None:
    await shard.lead()
    await dead_letter(shard, "dead")
    await shard.touch("rearm|ü", "plain")
    rearm, plain = sorted((await shard.claim()).claims, key=lambda c: c.key, reverse=True)
    assert (rearm.key, plain.key) == ("rearm|ü", "plain")
    await shard.touch("rearm|ü", window=LONG)  # during its run: a re-run queued
    await shard.touch("p", window=LONG)
    await shard.touch("q", window=LONG, rule="s")
    await shard.touch("corrupt", window=LONG)
    await shard.r.hset(shard.keys.meta, "corrupt", "not a state")
    plain_state = await shard.state("plain")
    before = await shard.now()

    found = await shard.scripts.cancel(shard.keys, [
        CancelGroup(RULE, ["p", "rearm|ü", "plain", "dead", "idle", "corrupt"]),
        CancelGroup("s", ["q"])], History("canceller", 100))

    assert found.states == {"p": "pending", "rearm|ü": "rearm", "plain": "running", "dead": "dead",
                     "idle": "idle", "corrupt": "pending", "q": "pending"}
    for key, rule in (("p", RULE), ("q", "s"), ("corrupt", RULE)):
        assert await shard.state(key) is None
        assert await shard.r.zscore(shard.keys.due(rule), key) is None
    assert await shard.fields("rearm|ü") == [
        "R", str(rearm.token), str(rearm.first_ms), str(rearm.last_ms), "1",
        str(rearm.due_ms), "", "", "", "n1"]
    assert await shard.state("plain") == plain_state
    assert await shard.dead("dead") is not None
    entries = await shard.r.xrange(shard.keys.history)
    cancels = [f for _, f in entries if f["outcome"] == "cancelled"]
    assert [(f["key"], f["rule"], f["node"]) for f in cancels] == [
        ("p", RULE, "canceller"), ("rearm|ü", RULE, "canceller"),
        ("corrupt", RULE, "canceller"), ("q", "s", "canceller")]
    assert all(int(f["start"]) >= before and f["ms"] == "0" for f in cancels)
    assert before < int(cancels[0]["due"]) <= before + LONG  # the due time dropped

    # the running refresh is acked as usual, with nothing to re-arm
    assert await shard.ack("rearm|ü", rearm.token) == []
    assert await shard.state("rearm|ü") is None
    assert (await shard.claim()).claims == []


async def test_a_touch_after_a_cancel_of_a_running_key_re_arms_it(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    claim = await shard.claim_one("k")
    await shard.touch("k", window=LONG)
    found = await shard.scripts.cancel(shard.keys, [CancelGroup(RULE, ["k"])])
    assert found.states == {"k": "rearm"}
    after = await shard.now()
    await shard.touch("k", window=0)
    fields = await shard.fields("k")
    assert int(fields[7]) >= after  # a fresh burst: its first touch is after the cancel
    assert await shard.fail("k", claim.token, delay=0) == (1, 0, [])
    retry = await shard.claim_one("k")
    assert retry.attempt == 2 and retry.last_ms >= after  # the retry carries the new touch


async def test_cancel_rewrites_an_older_running_state_without_its_re_arm(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    claim = await shard.claim_one("k")
    now = await shard.now()
    await shard.r.hset(shard.keys.meta, "k", f"R|{claim.token}|1|1|1|1|{now + LONG}|{now}|{now}")
    found = await shard.scripts.cancel(shard.keys, [CancelGroup(RULE, ["k"])])
    assert found.states == {"k": "rearm"}
    assert await shard.state("k") == f"R|{claim.token}|1|1|1|1||||"
    assert await shard.ack("k", claim.token) == []
    assert await shard.state("k") is None


async def test_a_cancel_answer_that_does_not_fit_the_keys_is_a_script_error(
        shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([[0, ["pending"], 0, []], [0, ["pending", "gone"], 0, []]])

    async def run(name: str, keys: Any, args: Any) -> Any:
        return next(answers)

    monkeypatch.setattr(shard.scripts, "_run", run)
    for _ in range(2):
        with pytest.raises(ScriptError, match="cancel answered"):
            await shard.scripts.cancel(shard.keys, [CancelGroup(RULE, ["a", "b"])])


async def test_requeue_brings_dead_keys_back_and_leaves_other_keys_alone(shard: Shard) -> None:
    await shard.lead()
    await dead_letter(shard, "d1")
    await dead_letter(shard, "d2")
    await shard.touch("pending", window=LONG)
    pending_state, pending_due = await shard.state("pending"), await shard.due("pending")

    before = await shard.now()
    requeued = await shard.scripts.requeue(shard.keys, RULE, ["d1", "pending", "unknown"])
    after = await shard.now()
    assert requeued == 1
    due = await shard.due("d1")
    assert due is not None and before <= due <= after
    assert await shard.dead("d1") is None
    assert (await shard.fields("d1"))[0::3] == ["P", "0"]
    assert await shard.dead("d2") is not None and (await shard.fields("d2"))[0] == "D"
    assert await shard.state("pending") == pending_state
    assert await shard.due("pending") == pending_due
    assert await shard.state("unknown") is None and await shard.due("unknown") is None
    assert (await shard.claim_one("d1")).attempt == 1


async def test_requeue_reports_a_key_named_twice_and_a_dead_state_outside_the_dead_set(
        shard: Shard) -> None:
    await shard.lead()
    for key in ("d1", "d2", "stray"):
        await dead_letter(shard, key)
    await shard.r.zrem(shard.keys.dead(RULE), "stray")  # dead in meta, not in dead:RULE

    done, not_dead = await shard.scripts.requeue_each(
        shard.keys, RULE, ["d1", "stray", "d1", "unknown", "d2"])

    assert (done, not_dead) == (2, ["stray", "d1", "unknown"])
    assert await shard.dead("d1") is None and await shard.dead("d2") is None
    assert (await shard.fields("d2"))[0::3] == ["P", "0"]
    assert (await shard.fields("stray"))[0] == "D" and await shard.due("stray") is None
    assert await shard.scripts.requeue_each(shard.keys, RULE, [], wake=False) == (0, [])


async def test_requeue_without_wake_leaves_the_poller_asleep_and_a_call_with_no_keys_wakes_it(
        shard: Shard) -> None:
    await shard.lead()
    await dead_letter(shard, "d1")
    far = str(await shard.now() + 10 * LONG)
    await shard.r.set(shard.keys.next_wake, far)

    assert await shard.scripts.requeue_each(shard.keys, RULE, ["d1"], wake=False) == (1, [])
    assert await shard.r.get(shard.keys.next_wake) == far
    before = await shard.now()
    assert await shard.scripts.requeue_each(shard.keys, RULE, []) == (0, [])
    woken = await shard.r.get(shard.keys.next_wake)
    assert woken is not None and before <= int(woken) < int(far)


# -- recover -------------------------------------------------------------------------------


async def test_recover_requeues_only_expired_leases_counting_the_attempt(shard: Shard) -> None:
    await shard.lead()
    await shard.touch("dies")
    dying = await shard.claim_one("dies", lease=1)
    await shard.touch("lives")
    living = await shard.claim_one("lives", lease=LONG)
    lease_until = await shard.inflight("dies")
    assert lease_until is not None
    await shard.after(lease_until)

    assert await shard.scripts.recover(shard.keys, [RULE], 100) == 1
    assert await shard.inflight("dies") is None and await shard.due("dies") is not None
    assert await shard.fields("dies") == [
        "P", str(dying.first_ms), str(dying.last_ms), "1"]
    assert await shard.inflight("lives") is not None
    assert (await shard.fields("lives"))[:2] == ["R", str(living.token)]
    assert await shard.scripts.recover(shard.keys, [RULE], 100) == 0

    again = await shard.claim_one("dies")
    assert again.attempt == 2 and again.token > dying.token


async def test_recover_of_listed_claims_requeues_only_those_whose_lease_was_not_renewed(
        shard: Shard) -> None:
    # a leader judging by its own clock lists claims with the lease score it read: one
    # whose lease is still far ahead by the server's clock is re-queued all the same, one
    # renewed since the read keeps its claim
    await shard.lead()
    await shard.touch("silent")
    silent = await shard.claim_one("silent", lease=LONG)
    await shard.touch("renewed")
    renewed = await shard.claim_one("renewed", lease=LONG)
    read = await shard.scripts.lease_scores(shard.keys, [RULE], 100, None)
    assert set(read[0]) == {"silent", "renewed"}
    await shard.after(read[0]["renewed"] - LONG + 1)
    assert await shard.scripts.renew(shard.keys, LONG, [(RULE, [("renewed", renewed.token)])]) == []
    listed = [[("silent", read[0]["silent"]), ("renewed", read[0]["renewed"])]]
    assert await shard.scripts.recover(shard.keys, [RULE], 100, [5], listed) == 1
    assert await shard.inflight("silent") is None and await shard.due("silent") is not None
    assert (await shard.fields("silent"))[3] == "1"  # the attempt that lapsed counts
    assert (await shard.fields("renewed"))[:2] == ["R", str(renewed.token)]
    assert (await shard.claim_one("silent")).token > silent.token


async def test_recover_gives_a_touch_during_a_dead_last_attempt_a_new_burst(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("last")
    first_try = await shard.claim_one("last")
    assert await shard.fail("last", first_try.token, attempts=2) == (1, 0, [])
    await shard.touch("middle")
    batch = await shard.claim(lease=1)  # their holder then dies: nothing renews these
    assert sorted((c.key, c.attempt) for c in batch.claims) == [("last", 2), ("middle", 1)]
    # a server millisecond later than both bursts began: what "during" is compared with
    during = await shard.after(max(c.first_ms for c in batch.claims))
    await shard.touch("last", "middle")  # while they run
    leases = [await shard.inflight(key) for key in ("last", "middle")]
    await shard.after(max(lease for lease in leases if lease is not None))

    assert await shard.scripts.recover(shard.keys, [RULE], 100, [2]) == 2
    # "last" died on its last attempt: the touch starts a new burst, fresh attempts
    state = await shard.fields("last")
    assert state[0] == "P" and int(state[1]) >= during and state[3] == "0"
    # "middle" died on attempt 1 of 2: the touch is merged into its retry
    state = await shard.fields("middle")
    assert state[0] == "P" and int(state[1]) < during and state[3] == "1"
    again = {c.key: c.attempt for c in (await shard.claim()).claims}
    assert again == {"last": 1, "middle": 2}


async def test_a_key_whose_holder_died_on_its_last_attempt_is_dead_after_that_many(
        shard: Shard) -> None:
    await shard.lead()
    await shard.touch("k")
    dying = await shard.claim_one("k", lease=1)  # attempt 1 of 1; its holder dies
    lease = await shard.inflight("k")
    assert lease is not None
    await shard.after(lease)
    assert await shard.scripts.recover(shard.keys, [RULE], 100, [1]) == 1
    past = await shard.claim_one("k")
    assert past.attempt == 2  # the runner fails it unrun: the limit is reached
    assert await shard.fail("k", past.token, attempts=1, error="lease expired") == (0, 1, [])
    assert await shard.fields("k") == [
        "D", str(dying.first_ms), str(dying.last_ms), "1", "lease expired"]


# -- leader lease --------------------------------------------------------------------------


async def test_acquire_grants_one_holder_with_growing_epochs(shard: Shard) -> None:
    s, keys = shard.scripts, shard.keys
    one = await s.acquire(keys, node_id="n1", lease_ms=10_000, mine="")
    assert one.granted and one.holder == f"{one.epoch}|n1"
    assert await shard.r.pttl(keys.leader) == -1  # the lease is the node's, not the key's

    other = await s.acquire(keys, node_id="n2", lease_ms=10_000, mine="")
    assert not other.granted and other.holder == one.holder
    assert await shard.r.get(keys.leader) == one.holder  # not overwritten
    assert other.live_nodes == 2

    kept = await s.acquire(keys, node_id="n1", lease_ms=10_000, mine=one.holder)
    assert kept.granted and kept.epoch == one.epoch and kept.holder == one.holder

    # Only the holder may release it.
    assert not await s.release(keys, value=f"{one.epoch}|n2", node_id="n2", leave=False)
    assert not await s.release(keys, value=f"{one.epoch + 1}|n1", node_id="n1", leave=False)
    assert await shard.r.get(keys.leader) == one.holder
    assert await s.release(keys, value=one.holder, node_id="n1", leave=False)
    assert await shard.r.get(keys.leader) is None

    two = await s.acquire(keys, node_id="n2", lease_ms=10_000, mine="")
    assert two.granted and two.epoch > one.epoch and two.holder == f"{two.epoch}|n2"
    # n1's old value does not keep n2's shard.
    stale = await s.acquire(keys, node_id="n1", lease_ms=10_000, mine=one.holder)
    assert not stale.granted and stale.holder == two.holder


async def test_a_take_over_needs_the_holder_value_seen_lapsing_and_fences_the_old_holder(
        shard: Shard) -> None:
    s, keys = shard.scripts, shard.keys
    one = await s.acquire(keys, node_id="n1", lease_ms=10_000, mine="")
    # a value n2 saw earlier, not the one held now: refused (compare-and-set)
    wrong = await s.acquire(keys, node_id="n2", lease_ms=10_000, mine="",
                            take_from=f"{one.epoch - 1}|n1")
    assert not wrong.granted
    async with shard.r.pubsub() as sub:
        await sub.subscribe(keys.wake_channel)
        took = await s.acquire(keys, node_id="n2", lease_ms=10_000, mine="",
                               take_from=one.holder)
        assert took.granted and took.epoch > one.epoch
        message = None
        while message is None or message["type"] != "message":
            message = await sub.get_message(timeout=5.0)
        assert message["data"] == "taken"  # the old holder, if alive, stops at once
    with pytest.raises(NotLeaderError):
        await shard.claim(leader=one.holder)
    # a later run of n2 (a restart under the same id) takes its own shard back
    again = await s.acquire(keys, node_id="n2", lease_ms=10_000, mine="")
    assert again.granted and again.epoch > took.epoch


async def test_node_leases_renew_with_one_call_and_drop_only_an_unchanged_lapsed_lease(
        shard: Shard) -> None:
    s, leases = shard.scripts, node_leases(shard.keys.namespace)
    first = await s.node_lease(leases, node_id="a", lease_ms=10_000)
    assert first.lapsed and set(first.ends) == {"a"}  # never held: counts as lapsed
    again = await s.node_lease(leases, node_id="a", lease_ms=10_000)
    assert not again.lapsed and again.ends["a"] != first.ends["a"]  # a renewal writes anew
    short = await s.node_lease(leases, node_id="b", lease_ms=20)
    look = await s.lease_look(leases)
    assert look.ends == {"a": again.ends["a"], "b": short.ends["b"]} and not look.lapsed
    # a drop names the lease end read: b renewed since, so it stays; then it is dropped
    await s.node_lease(leases, node_id="b", lease_ms=20)
    await s.node_lease(leases, node_id="a", lease_ms=10_000, forgotten=[("b", short.ends["b"])])
    assert set(await shard.r.zrange(leases, 0, -1)) == {"a", "b"}
    read = (await s.lease_look(leases)).ends["b"]
    await s.node_lease(leases, node_id="a", lease_ms=10_000, forgotten=[("b", read)])
    assert await shard.r.zrange(leases, 0, -1) == ["a"]
    assert (await s.node_lease(leases, node_id="b", lease_ms=20)).lapsed  # it was dropped
    await s.node_lease(leases, node_id="a", lease_ms=0)
    assert await shard.r.zrange(leases, 0, -1) == ["b"]


# -- surviving a lost script cache ---------------------------------------------------------


async def every_script(shard: Shard, between: Any) -> None:
    """Each of the nine scripts once, ``between()`` before each of them."""
    s, keys = shard.scripts, shard.keys
    await between()
    lease = await s.acquire(keys, node_id="n1", lease_ms=30_000, mine="")
    assert lease.granted
    shard.leader = lease.holder
    await between()
    await shard.touch("a", "b", "c")
    await between()
    batch = await shard.claim(lease=1)
    assert sorted(c.key for c in batch.claims) == ["a", "b", "c"]
    tokens = {c.key: c.token for c in batch.claims}
    await between()
    assert await s.renew(keys, LONG, [(RULE, [("a", tokens["a"])])]) == []
    await between()
    assert await shard.ack("a", tokens["a"]) == []
    await between()
    assert await shard.fail("b", tokens["b"], attempts=1) == (0, 1, [])
    await between()
    assert await s.requeue(keys, RULE, ["b"]) == 1
    await between()
    await shard.after(batch.now_ms + 1)
    assert await s.recover(keys, [RULE], 10) == 1  # "c": its 1 ms lease ran out
    await between()
    assert await s.release(keys, value=lease.holder, node_id="n1", leave=True)


async def test_script_flush_between_calls_breaks_no_script(shard: Shard) -> None:
    async def script_flush() -> None:
        await shard.r.script_flush()
    await every_script(shard, script_flush)


async def test_a_server_restart_between_calls_breaks_no_script(
        own_server: ValkeyProcess, namespace: str) -> None:
    # AOF on, so the data (the lease, the keys) survives each restart; only the
    # script cache is lost.
    own_server.extra_args = ["--appendonly", "yes", "--appendfsync", "always"]
    own_server.restart()
    # The same (coalescer-configured) client reconnecting after each restart.
    conn = await connect(own_server.url)
    try:
        async def restart() -> None:
            own_server.restart()
        await every_script(Shard(conn.client, namespace), restart)
    finally:
        await conn.close()

    # A new client after a restart.
    own_server.restart()
    client = redis.asyncio.Redis.from_url(own_server.url, decode_responses=True)
    try:
        shard = Shard(client, namespace + "-new")
        await shard.lead()
        await shard.touch("k")
        await shard.claim_one("k")
    finally:
        await client.aclose()
