"""The emulated floor of the fair order (bench/fair_floor.py) at a tiny size on a real
server, so it cannot rot: its edits still find the scripts' text, and a drain under it
refreshes every key from the exact queues alone (the claim script never sweeps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common as C
from bench import fair_floor as FF
from bench import fairness as FR
from bench.valkey import Server
from coalescer.store import script_calls

ORIGINAL = script_calls.script_source  # as the process has it, no floor


class Tiny(C.Sizes):
    fair = FR.FairSizes.tiny()


@pytest.mark.parametrize("name", ["upsert", "claim"])
def test_the_floor_edits_the_touch_and_claim_scripts(name: str) -> None:
    source = script_calls.script_source(name)

    edited = FF.floor_source(name, source)

    assert edited != source


def test_the_floor_leaves_every_other_script_as_it_is() -> None:
    source = script_calls.script_source("ack")

    assert FF.floor_source("ack", source) == source


def test_an_edit_that_no_longer_finds_its_text_says_which() -> None:
    with pytest.raises(RuntimeError, match="fair_sweep"):
        FF.floor_source("claim", "-- a claim script without a sweep\n")


async def test_equal_tenants_drain_from_the_exact_queues_alone(tmp_path: Path) -> None:
    with Server(tmp_path) as server, server.client() as r:
        out = await FF.balanced(server, Tiny())
        state = {k.decode() if isinstance(k, bytes) else k: v
                 for k, v in r.hgetall(FF.QUEUES + "state").items()}

    n = FR.FairSizes.tiny().fair_balanced
    assert out["drained"] and all(t["started"] == n for t in out["tenants"].values())
    assert "v" in state and "swept" not in state  # claimed, and never swept due:RULE
    assert script_calls.script_source is ORIGINAL  # the floor's scripts are gone

