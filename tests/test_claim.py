"""Claim: the frozen object a handler receives, however it was built."""

from __future__ import annotations

import dataclasses

import pytest

from coalescer.claim import Claim, granted
from coalescer.store.script_types import ClaimedKey


def test_a_claim_the_runner_builds_equals_the_keyword_one_and_is_frozen() -> None:
    c = ClaimedKey(rule_index=0, key="stats:user:7", token=41, first_ms=1_000, last_ms=1_200,
                   attempt=2, due_ms=1_700)
    built = granted(c, "user", {"id": "7"})
    assert built == Claim(key="stats:user:7", rule="user", params={"id": "7"}, attempt=2,
                          first_touch_ms=1_000, last_touch_ms=1_200, due_ms=1_700, token=41)
    assert built.to_json()["params"] == {"id": "7"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.token = 42  # type: ignore[misc]
