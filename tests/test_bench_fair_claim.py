"""The fair claim script's benches (bench/fair_claim_cost.py, fair_claim_breakdown.py)
at a small size on a real server, so they cannot rot: the timed copy of the script
still finds each step it times, every step is timed, and the keys are all claimed."""

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
