"""The fair claim script's cost bench (bench/fair_claim_cost.py) at a small size on a
real server, so it cannot rot: every comparison's sides write and claim all their keys,
and a side that claims fewer keys than it wrote is an error, not a figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fair_claim_cost as cost
from bench.valkey import Server


async def test_every_claim_cost_comparison_claims_all_its_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 3000)
    monkeypatch.setattr(cost, "LATER", 500)
    monkeypatch.setattr(cost, "ROUNDS", 1)
    with Server(tmp_path) as server:
        found = await cost.measure(server)

    assert set(found) == set(cost.COMPARISONS)
    assert all(us > 0 for a, b in found.values() for run in (*a, *b) for us in run)


async def test_a_side_that_claims_too_few_keys_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 300)
    never = cost.Setup(limit=0)  # a rule whose claims may take no key
    with Server(tmp_path) as server, pytest.raises(RuntimeError, match="took 0 of the 300"):
        await cost.claim_all(server, "none", never)
