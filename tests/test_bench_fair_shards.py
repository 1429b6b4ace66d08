"""The fair-across-shards benchmark (bench/fairness_shards.py): its share figures on
known start orders, and the ``fair_shards`` group run end to end at a tiny size through
bench.run's own groups and table, so it cannot rot. The figures themselves are the
bench's; only counts are asserted here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import common as C
from bench import fairness_shards as FS
from bench import run as R
from tests.helpers.bench_tables import figure_names

WEIGHTS = {"x": 5, "y": 3, "z": 2}


def test_a_start_order_in_weight_proportion_has_no_share_error_but_leads_within_a_round() -> None:
    order = (["x"] * 5 + ["y"] * 3 + ["z"] * 2) * 10

    got = FS.share_errors(order, WEIGHTS)

    assert got["counts"] == {"x": 50, "y": 30, "z": 20}
    assert got["max_error_percent"] == pytest.approx(0)
    assert got["max_drift_claims"] == pytest.approx(2.5)  # x's five in a row: 5 against 2.5


def test_a_tenant_served_last_shows_its_whole_share_as_error() -> None:
    order = ["x"] * 60 + ["y"] * 40  # z none

    got = FS.share_errors(order, WEIGHTS)

    assert got["error_percent"]["z"] == pytest.approx(-100)
    assert got["max_error_percent"] == pytest.approx(100)


def test_window_errors_slide_over_every_run_of_consecutive_starts() -> None:
    even = FS.window_errors(["a", "b"] * 50, {"a": 1, "b": 1}, window=4)
    blocks = FS.window_errors(["a"] * 4 + ["b"] * 4, {"a": 1, "b": 1}, window=4)

    assert even["windows"] == 97
    assert even["window_max_claims"] == 0
    assert blocks["windows"] == 5
    assert blocks["window_max_claims"] == 2  # aaaa: 4 against 2
    assert blocks["window_max_error_percent"] == pytest.approx(100)
    assert FS.window_errors(["a"], {"a": 1}, window=4) == {"windows": 0}


class Tiny(C.Sizes):
    fair_shards = FS.ShardSizes.tiny()


@pytest.mark.slow  # eleven measurements, a 3-master Cluster among them: ~40 s
async def test_the_fair_shards_group_runs_and_fills_its_rows(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    await R.run_group("fair_shards", Tiny(), tmp_path, results, 1)
    runs = {s: r["runs"][0] for s, r in results["fair_shards"].items()}
    assert not {s: r["error"] for s, r in runs.items() if "error" in r}
    n = FS.ShardSizes.tiny().claims
    for system, run in runs.items():
        if system.startswith(("weighted", "equal")):
            assert sum(run["counts"].values()) == sum(run["starts_per_shard"]) == n
            assert run["leads"] == {"shards-bench": run["shards"]}
        if system.startswith("quiet"):
            assert 0 <= run["starts_before"] <= n
    assert runs["cap_16"]["max_running_seen"] <= FS.CAP
    assert runs["cap_16"]["claims"] == runs["cap_cluster_16"]["claims"]
    rows = [r for r in R.rows(results, Tiny()) if r["figure"] in _figures()]
    assert len(rows) == len(_figures())
    assert all(r["coalescer"] != "n/a" for r in rows)


def _figures() -> set[str]:
    return figure_names(FS.rows, Tiny())
