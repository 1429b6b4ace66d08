"""``edge: leading`` against its reference model (tests/helpers/debounce_model.py).

The model is first held to lodash's ``debounce(f, W, {leading: true, trailing: true,
maxWait})``; then random traces of touches, claims and acks of one key run through the
real scripts on a real server, on a virtual clock (tests/helpers/leading_traces.py),
and every claim must be the model's: when it starts, its due time, the touches (items)
it covers. 150 traces run here; ``pytest -m slow`` runs
``$LEADING_TRACES`` more (5,000 by default; 100000 for the full check), from seed
``$LEADING_SEED`` (2): runs with other seeds at once share the work between cores."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio

from coalescer.store.keys import KeySpace
from tests.helpers.debounce_model import Run, instant_runs, lodash_debounce
from tests.helpers.leading_traces import Played, Player, Trace, random_trace
from tests.helpers.virtual_clock import VirtualClockScripts

BASE = 1_700_000_000_000  # the virtual clock's first trace
SPACING = 10**7  # ms between the traces' bases


@pytest_asyncio.fixture
async def player(redis_url: str, namespace: str) -> AsyncIterator[Player]:
    r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        scripts = VirtualClockScripts(r, f"{namespace}:clock")
        yield Player(scripts, KeySpace(namespace, 1).shard(0))
    finally:
        await r.aclose()


async def play_many(player: Player, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    failures = []
    for n in range(count):
        trace = random_trace(rng)
        played = await player.play(trace, BASE + n * SPACING)
        if played.problems:
            failures.append(f"seed {seed} trace {n}: {trace}: {played.problems[:3]}")
    return failures


def test_the_model_is_lodash_when_no_burst_reaches_max_wait() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        window = 2 * rng.choice([5, 20, 50]) + 1  # odd: no timer meets a call (all odd)
        t, calls = 0, []
        for n in range(rng.randint(1, 12)):
            t += rng.choice([rng.randint(1, window), rng.randint(window, 3 * window)])
            calls.append((2 * t + 1, f"c{n}"))
        lodash = [(r.start, r.labels) for r in lodash_debounce(calls, window, 10**12)]
        model = [(r.start, r.labels) for r in instant_runs(calls, window, 10**12)]
        assert model == lodash, calls


async def test_random_traces_through_the_scripts_match_the_model(player: Player) -> None:
    assert await play_many(player, seed=1, count=150) == []


@pytest.mark.slow
async def test_many_random_traces_through_the_scripts_match_the_model(
        player: Player) -> None:
    count = int(os.environ.get("LEADING_TRACES", "5000"))
    seed = int(os.environ.get("LEADING_SEED", "2"))
    failures = await play_many(player, seed=seed, count=count)
    assert failures == [], f"{len(failures)} of {count} traces diverged: {failures[:5]}"


async def play(player: Player, touches: tuple[int, ...], *, window: int = 1000,
               max_wait: int = 2000, lag: int = 0, durations: tuple[int, ...] = (0,),
               ) -> list[Run]:
    played: Played = await player.play(Trace(touches, lag, durations, window, max_wait),
                                       BASE)
    assert played.problems == []
    assert played.runs == played.model_runs
    return played.runs


async def test_one_touch_runs_once_never_a_second_time(player: Player) -> None:
    runs = await play(player, (0,))
    assert [(r.start, r.labels, r.leading) for r in runs] == [(0, ("t0",), True)]


async def test_touches_before_the_leading_claim_join_it_and_run_once(player: Player) -> None:
    # a leading variant that ran again for touches its leading run had already covered
    runs = await play(player, (0, 3, 9), lag=10)
    assert [(r.start, sorted(r.labels)) for r in runs] == [(10, ["t0", "t1", "t2"])]


async def test_a_burst_past_max_wait_has_no_leading_run_in_its_middle(
        player: Player) -> None:
    # a burst of touches every 400 ms for 5 s (window 1 s, max_wait 2 s): after a
    # max-wait refresh the burst goes on, so its next touch is no leading edge (a known
    # bug elsewhere fired one there)
    touches = tuple(range(0, 5001, 400))
    runs = await play(player, touches)
    assert runs[0].leading and runs[0].labels == ("t0",)
    assert not any(r.leading for r in runs[1:])
    assert [r.start for r in runs] == [0, 2400, 4800]  # max_wait from 400, 2800
    assert sorted(label for r in runs for label in r.labels) == sorted(
        f"t{n}" for n in range(len(touches)))


async def test_a_touch_just_before_the_max_wait_deadline_never_pushes_past_it(
        player: Player) -> None:
    # the trailing burst starts at 100; a touch at 2099 (1 ms before its max_wait
    # deadline) must not move the refresh to 2099 + window (a known bug elsewhere)
    runs = await play(player, (0, 100, 900, 1700, 2099))
    assert [(r.start, r.due) for r in runs] == [(0, 0), (2100, 2100)]
    assert runs[1].labels == ("t1", "t2", "t3", "t4")


async def test_a_touch_during_a_run_makes_exactly_one_more(player: Player) -> None:
    runs = await play(player, (0, 100, 200), durations=(5000,))
    assert [(r.start, r.labels) for r in runs] == [(0, ("t0",)), (5000, ("t1", "t2"))]


async def test_a_touch_a_window_after_the_last_touch_is_a_leading_edge_again(
        player: Player) -> None:
    # quiet counts from the last touch, not from the last refresh
    runs = await play(player, (0, 999, 1999, 2999, 3999))
    assert [(r.start, r.labels, r.leading) for r in runs] == [
        (0, ("t0",), True), (2999, ("t1", "t2", "t3"), False), (3999, ("t4",), True)]
