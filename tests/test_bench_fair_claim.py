"""The fair claim script's cost bench (bench/fair_claim_cost.py) at a small size on a
real server, so it cannot rot: every shape's two sides write and claim all their keys,
each call timed, and a side that claims fewer keys than it wrote is an error, not a
figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fair_claim_cost as cost
from bench.valkey import Server


async def test_every_shape_times_each_write_and_claim_call_of_both_sides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 3000)
    monkeypatch.setattr(cost, "LATER", 500)
    with Server(tmp_path) as server:
        found = await cost.measure(server)

    assert set(found) == set(cost.SHAPES)
    for fair, plain in found.values():
        assert (fair.fair, plain.fair) == (True, False)
        for side in (fair, plain):
            assert side.claimed == 3000
            assert len(side.writes) == 3000 // cost.WRITE
            assert len(side.claims) == -(-3000 // cost.LIMIT)  # 32 a call, the last fewer
            assert all(us > 0 for us in side.writes + side.claims)
    lines = cost.report(found)
    assert len(lines) == 2 * len(cost.SHAPES)
    assert all(line.startswith(tuple(cost.SHAPES)) and line.endswith("x") for line in lines)


async def test_a_side_that_claims_too_few_keys_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "N", 300)
    with Server(tmp_path) as server, pytest.raises(RuntimeError, match="took 0 of the 300"):
        await cost.compare(server, "none", cost.Shape(), limit=0)  # no claim may take a key
