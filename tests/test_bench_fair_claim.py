"""The fair claim script's benches (bench/fair_claim_cost.py, fair_claim_breakdown.py)
at a small size on a real server, so they cannot rot: the timed copy of the script
still finds each step it times, every step is timed, and every comparison's sides
claim all their keys (the exact queues of the emulated floor too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fair_claim_breakdown as breakdown
from bench import fair_claim_cost as cost
from bench.valkey import Server


async def test_the_breakdown_times_every_step_of_the_fair_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 3000)
    with Server(tmp_path) as server:
        steps, plain = await breakdown.measure(server)

    assert set(steps) == {*breakdown.STEPS, "the whole script"}
    assert all(us > 0 for us in steps.values()) and plain > 0
    assert max(us for name, us in steps.items() if name != "the whole script") \
        <= steps["the whole script"]


async def test_every_claim_cost_comparison_claims_all_its_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 3000)
    monkeypatch.setattr(cost, "LATER", 500)
    monkeypatch.setattr(cost, "ROUNDS", 1)
    with Server(tmp_path) as server:
        found = await cost.measure(server)

    assert set(found) == set(cost.COMPARISONS)
    assert all(us > 0 for a, b in found.values() for us in (*a, *b))


async def test_a_side_that_claims_too_few_keys_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 300)
    never = cost.Setup(edit=lambda name, source: source.replace(
        "local fair = fair_specs(5 + rules)", "local fair = nil\nrules = 0", 1))
    with Server(tmp_path) as server, pytest.raises(RuntimeError, match="took 0 of the 300"):
        await cost.claim_all(server, "none", never)
