"""A claim call's grants enter the handler slots it reserved; unused ones go back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from coalescer.worker.claims import ClaimedKey, Taken, claim_into_slots


@dataclass
class Rule:
    name: str


class Slots:
    """Free slots per rule; records the claims started."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = dict(free)
        self.started: list[tuple[str, str]] = []
        self.offsets: list[float] = []

    def reserve(self, rule: Any, most: int, *, queue: bool = True) -> int:
        n = min(most, self.free[rule.name])
        self.free[rule.name] -= n
        return n

    def unreserve(self, rule: Any, n: int) -> None:
        self.free[rule.name] += n

    def start_all(self, shard: int, rules: Sequence[Any], claims: Sequence[ClaimedKey],
                  clock_offset_ms: float, *, taken: list[int], sent: float) -> None:
        for c in claims:
            self.started.append((rules[c.rule_index].name, c.key))
            taken[c.rule_index] += 1
        self.offsets.append(clock_offset_ms)


def claimed(rule_index: int, key: str) -> ClaimedKey:
    return ClaimedKey(rule_index=rule_index, key=key, token=1, first_ms=0, last_ms=0,
                      attempt=1, due_ms=0)


RULES = [Rule("a"), Rule("b")]


async def test_the_limits_are_the_free_slots_and_the_unused_ones_go_back() -> None:
    slots = Slots({"a": 3, "b": 5})
    asked: list[list[tuple[str, int]]] = []

    async def call(limits: list[tuple[str, int]]) -> Taken:
        asked.append(limits)
        return Taken(0, [claimed(0, "a:1"), claimed(1, "b:1"), claimed(1, "b:2")])
    _, limits, taken = await claim_into_slots(slots, 7, RULES, 4, call)
    assert asked == [[("a", 3), ("b", 4)]]
    assert (limits, taken) == ([3, 4], [1, 2])
    assert slots.started == [("a", "a:1"), ("b", "b:1"), ("b", "b:2")]
    assert slots.free == {"a": 2, "b": 3}  # only the started claims hold a slot


async def test_a_failed_call_gives_every_reserved_slot_back() -> None:
    slots = Slots({"a": 3, "b": 5})

    async def call(limits: list[tuple[str, int]]) -> Taken:
        raise ConnectionError("Redis is down")
    with pytest.raises(ConnectionError):
        await claim_into_slots(slots, 7, RULES, 4, call)
    assert slots.free == {"a": 3, "b": 5}
    assert slots.started == []
