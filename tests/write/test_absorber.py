"""The in-process absorber (coalescer/write/absorber.py): no Redis, real rules."""

from __future__ import annotations

import pytest

from coalescer import BackpressureError, Config, UnknownKeyError
from coalescer.config.rules import Rule
from coalescer.write.absorber import Absorber
from coalescer.write.recent_writes import RecentWrites
from tests.helpers.servers import poll_until

RULES = """\
namespace: t
defaults: {window: 10s, max_wait: 1m}
rules:
  - name: fast
    match: "fast:{id}"
    absorb: 20ms
    handler: builtins:print
  - name: slow
    match: "slow:{id}"
    absorb: 5s
    handler: builtins:print
"""

CONFIG = Config.from_string(RULES)
FAST, SLOW = CONFIG.rule("fast"), CONFIG.rule("slow")


def match(key: str) -> Rule:
    return CONFIG.match(key)[0]


def make(max_keys: int = 1000) -> tuple[Absorber, list[int]]:
    absorber = Absorber(match, max_keys=max_keys)
    wakes: list[int] = []
    absorber.set_waker(lambda: wakes.append(1))
    return absorber, wakes


def test_touches_of_a_buffered_key_are_absorbed_and_counted_not_dropped() -> None:
    a, _ = make()
    for _ in range(5):
        a.touch("fast:1")
    a.touch("slow:1")
    assert len(a) == 2
    assert (a.touches, a.absorbed) == (6, 4)
    batch = a.take()
    assert batch == {"fast:1": FAST, "slow:1": SLOW}
    assert len(a) == 2 and a.take() == {}  # being written: not in Redis yet
    a.written(batch)
    assert len(a) == 0


def test_a_fresh_touch_wakes_the_flusher_once() -> None:
    a, wakes = make()
    a.touch("fast:1")
    a.touch("fast:1")
    a.touch("fast:2")
    assert len(wakes) == 1  # the flusher is awake until it says it is idle again
    a.take()
    a.idle = True
    a.touch("fast:3")
    assert len(wakes) == 2


def test_a_touch_of_a_held_key_still_wakes_an_idle_flusher() -> None:
    """Else the flusher sleeps its idle check (1 s), not the key's absorb interval."""
    a, wakes = make()
    a.touch("fast:1")
    a.written(a.take())
    a.idle = True  # the flusher found nothing to send and went to sleep
    wakes.clear()
    a.touch("fast:1")
    assert wakes == [1]
    assert a.take() == {}  # held: the woken flusher sleeps only until its release
    wait = a.next_ready_in()
    assert wait is not None and wait <= FAST.absorb


def test_a_key_written_within_its_absorb_interval_is_held_then_released() -> None:
    a, _ = make()
    a.touch("fast:1")
    a.touch("slow:1")
    a.written(a.take())  # both in Redis now: each is recent for its rule's absorb

    a.touch("fast:1")
    a.touch("slow:1")
    a.touch("fast:1")
    assert a.absorbed == 1
    assert a.take() == {}  # both held
    assert len(a) == 2
    wait = a.next_ready_in()
    assert wait is not None and 0.0 <= wait <= FAST.absorb

    # The fast key comes out once its 20 ms have passed; the slow one stays held.
    assert poll_until(a.take, timeout=2.0, message="fast:1 released") == {"fast:1": FAST}
    assert a.take() == {}
    slow_wait = a.next_ready_in()
    assert slow_wait is not None and FAST.absorb < slow_wait <= SLOW.absorb


def test_a_key_not_recently_written_is_never_held() -> None:
    a, _ = make()
    a.touch("slow:1")
    a.written(a.take())
    a.touch("slow:2")
    assert a.next_ready_in() == 0.0
    assert a.take() == {"slow:2": SLOW}


def test_take_everything_includes_held_keys() -> None:
    a, _ = make()
    a.touch("slow:1")
    a.written(a.take())
    a.touch("slow:1")
    a.touch("fast:1")
    assert a.take(everything=True) == {"slow:1": SLOW, "fast:1": FAST}
    assert a.next_ready_in() is None


def test_give_back_after_a_failed_write_loses_nothing() -> None:
    a, _ = make()
    a.touch("fast:1")
    a.touch("fast:2")
    batch = a.take()
    a.touch("fast:2")  # touched again while the write was in flight
    a.touch("fast:3")
    a.give_back(batch)  # the write failed
    assert len(a) == 3
    assert a.take() == {"fast:1": FAST, "fast:2": FAST, "fast:3": FAST}


def test_max_keys_refuses_new_keys_naming_them_and_keeps_the_accepted() -> None:
    a, _ = make(max_keys=3)
    for key in ("fast:1", "fast:2", "slow:1"):
        a.touch(key)
    with pytest.raises(BackpressureError, match="fast:4"):
        a.touch("fast:4")
    assert len(a) == 3 and a.touches == 3
    a.touch("fast:1")  # a key already buffered costs nothing: still accepted
    assert a.absorbed == 1
    batch = a.take(everything=True)
    assert batch == {"fast:1": FAST, "fast:2": FAST, "slow:1": SLOW}
    with pytest.raises(BackpressureError, match="fast:4"):
        a.touch("fast:4")  # keys being written still count against the bound
    a.give_back(batch)  # the write failed: all three are back, still no room
    with pytest.raises(BackpressureError, match="fast:4"):
        a.touch("fast:4")
    a.written(a.take(everything=True))
    a.touch("fast:4")  # room again once the buffer is in Redis
    assert len(a) == 1


def test_an_unknown_key_is_refused_by_name_and_buffers_nothing() -> None:
    a, wakes = make()
    with pytest.raises(UnknownKeyError, match="other:1") as info:
        a.touch("other:1")
    assert info.value.key == "other:1"
    with pytest.raises(UnknownKeyError):
        a.touch("fast:1:extra")  # {id} captures one ':'-free segment
    assert len(a) == 0 and a.take(everything=True) == {}
    assert (a.touches, a.absorbed) == (0, 0) and wakes == []


def test_a_hot_key_is_held_for_most_of_its_absorb_interval_after_each_write() -> None:
    a, _ = make()
    written = 0
    for _ in range(50):  # a hot key touched between writes, as the flusher sees it
        a.touch("slow:hot")
        batch = a.take()
        if batch:
            written += 1
            a.written(batch)
    assert written == 1  # one write per absorb interval, however many touches
    wait = a.next_ready_in()
    assert wait is not None and SLOW.absorb * 7 / 8 < wait <= SLOW.absorb


def test_recent_writes_never_remember_more_than_max_keys() -> None:
    recent = RecentWrites(max_keys=100)
    for n in range(3):
        recent.add({f"slow:{n}:{i}": SLOW for i in range(60)})
        assert len(recent) <= 100
    a, _ = make(max_keys=100)
    for start in (0, 80):
        for i in range(start, start + 80):
            a.touch(f"slow:{i}")
        a.written(a.take())  # past the bound: the oldest writes are forgotten, not kept
    a.touch("slow:0")
    assert a.take() == {"slow:0": SLOW}  # forgotten: written again, never lost


def test_keys_of_rules_with_different_absorb_intervals_are_held_each_for_its_own() -> None:
    recent = RecentWrites(max_keys=1000)
    recent.add({"fast:1": FAST, "slow:1": SLOW, "slow:2": SLOW})
    expiries = recent.expiries({"fast:1": FAST, "slow:1": SLOW, "slow:3": SLOW})
    assert set(expiries) == {"fast:1", "slow:1"}  # slow:3 was never written
    assert expiries["slow:1"] - expiries["fast:1"] == pytest.approx(SLOW.absorb - FAST.absorb,
                                                                      abs=0.01)


def test_a_key_touched_while_its_write_is_in_flight_is_held_until_that_write_ends() -> None:
    a, _ = make()
    a.touch("fast:1")
    first = a.take()
    a.touch("fast:1")  # re-touched while ``first`` is being written
    a.touch("fast:2")
    assert a.take() == {"fast:2": FAST}  # another write may go meanwhile, not of fast:1
    assert a.take() == {} and a.next_ready_in() is None  # it waits for the write to end
    assert len(a) == 3

    a.written(dict(first), first.since)  # a part of the batch, as the flusher reports it
    assert a.take() == {}  # still in flight until the batch is finished
    a.finished(first)
    wait = a.next_ready_in()  # now recent: held for its absorb interval, then written
    assert wait is not None and 0.0 < wait <= FAST.absorb
    assert poll_until(a.take, timeout=2.0, message="fast:1 released") == {"fast:1": FAST}


def test_a_key_given_back_while_retouched_is_written_once_its_batch_is_finished() -> None:
    a, _ = make()
    a.touch("fast:1")
    batch = a.take()
    a.touch("fast:1")
    a.give_back(batch)  # the write failed: nothing is held any more, nothing lost
    assert a.take() == {"fast:1": FAST}


# -- items ----------------------------------------------------------------------------------

ITEM_CONFIG = Config.from_string(RULES.replace(
    "    absorb: 20ms\n", "    absorb: 20ms\n    items: {max: 2}\n", 1))


def item_absorber(max_keys: int = 1000, max_items: int | None = None) -> Absorber:
    absorber = Absorber(lambda key: ITEM_CONFIG.match(key)[0], max_keys=max_keys,
                        max_items=max_items)
    absorber.set_waker(lambda: None)
    return absorber


def test_items_go_with_their_keys_and_past_max_become_an_overflow_mark() -> None:
    a = item_absorber()
    for item in ("x", "y", "x", "z"):
        a.touch_item("fast:1", item)
    a.touch("fast:2")
    batch = a.take()
    assert set(batch) == {"fast:1", "fast:2"}
    assert {k: set(v) for k, v in batch.item_sets.items()} == {"fast:1": {"x", "y", ""}}
    a.written(batch, items=batch.item_sets)
    assert a.take().item_sets == {}  # nothing left behind


def test_a_held_keys_items_wait_with_it() -> None:
    a = item_absorber()
    a.touch_item("fast:1", "x")
    a.written(a.take())  # fast:1 is now held for its absorb interval
    a.touch_item("fast:1", "y")
    assert a.take() == {}
    batch = poll_until(a.take, message="fast:1 released")
    assert {k: set(v) for k, v in batch.item_sets.items()} == {"fast:1": {"y"}}


def test_given_back_items_merge_with_later_ones_within_max() -> None:
    a = item_absorber()
    a.touch_item("fast:1", "x")
    batch = a.take()
    a.touch_item("fast:1", "y")
    a.touch_item("fast:1", "z")  # a third one while the write was in flight: overflow
    a.give_back(batch, items=batch.item_sets)
    again = a.take(everything=True)
    merged = set(again.item_sets["fast:1"])  # the given-back one first, then one of y, z
    assert len(merged) == 3 and {"x", ""} < merged
    a.written(again, items=again.item_sets)


def test_buffered_items_are_bounded_and_touch_items_applies_all_or_nothing() -> None:
    a = item_absorber(max_keys=3, max_items=3)
    a.touch_items([("fast:1", "a"), ("fast:2", "b")])
    with pytest.raises(BackpressureError, match="items are already buffered"):
        a.touch_items([("fast:3", "c"), ("fast:3", "d")])
    with pytest.raises(BackpressureError, match="new keys refused"):
        a.touch_items([("fast:3", "c")], keys=["fast:4"])
    a.touch_item("fast:3", "c")
    with pytest.raises(BackpressureError, match="items are already buffered"):
        a.touch_item("fast:1", "z")
    with pytest.raises(BackpressureError, match="keys are already buffered"):
        a.touch_item("fast:9", "z")
    batch = a.take()
    assert {k: set(v) for k, v in batch.item_sets.items()} == {
        "fast:1": {"a"}, "fast:2": {"b"}, "fast:3": {"c"}}
    a.written(batch, items=batch.item_sets)
    a.touch_item("fast:1", "z")  # room again once they are written


def test_waiting_touches_with_items_go_in_as_room_frees() -> None:
    a = item_absorber(max_keys=2)
    entries = a.rules_of_items([("fast:1", "a"), ("fast:2", "b"), ("fast:3", "c")])
    assert a.offer(entries, 0) == 2
    batch = a.take()
    a.written(batch, items=batch.item_sets)
    assert a.offer(entries, 2) == 3
    assert {k: set(v) for k, v in a.take().item_sets.items()} == {"fast:3": {"c"}}
