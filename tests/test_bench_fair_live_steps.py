"""The live profile of the fair claim (bench/fair_live_steps.py) at a tiny size on a real
server, so it cannot rot: every system drains the import, the claims it counts are the
keys that started, the timed runs report the claim script's steps, and the scripts and
the claim method are the process's own again afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common as C
from bench import fair_live_steps as LS
from bench import fairness as FR
from bench.valkey import Server
from coalescer.store import script_calls
from coalescer.store.claim_scripts import ClaimScripts

SCRIPTS, CLAIM = script_calls.script_source, ClaimScripts.claim  # as the process has them


class Tiny(C.Sizes):
    fair = FR.FairSizes.tiny()


@pytest.mark.slow  # three drains with their quiet seconds, about 10 s: run apart (pytest -m slow)
async def test_one_round_profiles_each_system_and_leaves_the_process_as_it_was(
        tmp_path: Path) -> None:
    with Server(tmp_path) as server:
        found = await LS.measure(server, Tiny(), rounds=1)

    rows = {row["system"]: row for row in found[0]}
    assert list(rows) == list(LS.SYSTEMS)
    n = FR.FairSizes.tiny().fair_import
    for row in rows.values():
        assert row["claimed"] >= n and row["calls"] > 0
        assert row["server_cpu_s"] > 0
    steps = rows["steps"]["steps_us_per_key"]
    assert steps["the whole script"] > steps["claims (as plain due order's)"] > 0
    assert "steps_us_per_key" not in rows["fair"]
    assert script_calls.script_source is SCRIPTS and ClaimScripts.claim is CLAIM
    assert "drain, off over fair in each round" in LS.report(found)


def test_counting_claims_puts_the_claim_method_back() -> None:
    with LS.counted_claims() as counts:
        assert ClaimScripts.claim is not CLAIM

    assert ClaimScripts.claim is CLAIM and counts == {}
