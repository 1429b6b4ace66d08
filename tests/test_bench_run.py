"""bench.run's rounds: a group's systems take turns, the order reversed every other
round, so a machine that drifts over a group's minutes favours no side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import common as C
from bench import run as R
from bench.valkey import Server


async def test_a_groups_systems_run_in_rounds_each_first_in_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    async def measure(server: Server, sizes: C.Sizes, side: str) -> dict[str, Any]:
        assert server.client().ping()  # a live server
        order.append(side)
        return {"side": side}

    monkeypatch.setitem(R.GROUPS, "turns", [("coalescer", measure, ("a",)),
                                            ("baseline", measure, ("b",))])
    results: dict[str, Any] = {}
    await R.run_group("turns", C.Sizes(), tmp_path, results, 4)

    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [r["side"] for r in results["turns"]["coalescer"]["runs"]] == ["a"] * 4
    assert [r["side"] for r in results["turns"]["baseline"]["runs"]] == ["b"] * 4
