"""The fairness benchmark (bench/fairness.py, bench/fairness_cap.py) run end to end at a
tiny size through bench.run's own groups and table, so it cannot rot: every measurement
runs on a real server (three ``coalescer run`` processes for the cap), each refreshes
every key it touched, and every row of the table gets a figure. The figures themselves
(timings) are the bench's, not asserted here; only counts are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import common as C
from bench import fairness as FR
from bench import fairness_cap as FC
from bench import fairness_rows
from bench import run as R
from tests.helpers.bench_tables import figure_names

GROUPS = ("fair_skew", "fair_skew_work", "fair_balanced", "fair_weights", "fair_cap", "herd",
          "fair_memory")


class Tiny(C.Sizes):
    fair = FR.FairSizes.tiny()


def fair_known() -> bool:
    return FR.fair_refused(FR.tenant_rules(FR.fair_block())) is None


@pytest.mark.slow  # seven groups, three node processes among them: ~35 s
async def test_every_fairness_group_runs_and_fills_its_rows(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    for group in GROUPS:
        await R.run_group(group, Tiny(), tmp_path, results, 1)
    runs = {f"{g}.{s}": r["runs"][0] for g, systems in results.items()
            for s, r in systems.items()}
    assert not {k: r["error"] for k, r in runs.items() if "error" in r}
    skipped = {k for k, r in runs.items() if "skipped" in r}
    assert skipped == ({k for k in runs if k.endswith(".coalescer") and k != "herd.coalescer"}
                       if not fair_known() else set())
    _check_counts(runs, skipped)
    figures = [r for r in R.rows(results, Tiny()) if r["figure"] in _fair_figures()]
    assert len(figures) == len(_fair_figures())
    for row in figures:
        assert row["baseline"] != "n/a" or row["coalescer"] != "n/a", row["figure"]


def _check_counts(runs: dict[str, dict[str, Any]], skipped: set[str]) -> None:
    fs = FR.FairSizes.tiny()
    live = {k: r for k, r in runs.items() if k not in skipped}
    imports = {"fair_skew": fs.fair_import, "fair_skew_work": fs.fair_import_work}
    for where, run in live.items():
        if where.split(".")[0] in imports:
            assert run["a"]["started"] == imports[where.split(".")[0]]
            assert run["b"]["n"] == run["b_touches"] > 0
    for where in ("fair_balanced.coalescer", "fair_balanced.baseline"):
        if where in live:
            assert all(t["started"] == fs.fair_balanced for t in live[where]["tenants"].values())
    herd = runs["herd.coalescer"]
    assert herd["herd_drain"]["started"] == fs.herd
    assert herd["n"] == herd["other_touches"] > 0
    for where in ("fair_cap.coalescer", "fair_cap.baseline"):
        if where in live:
            assert live[where]["starts"] == live[where]["ends"] == live[where]["claims"]
    # with nothing capping the runs, the count from outside does find tenants over the cap
    assert runs["fair_cap.baseline"]["over_cap_moments"] > 0
    if "fair_cap.coalescer" in live:
        assert live["fair_cap.coalescer"]["over_cap_moments"] == 0
        assert live["fair_cap.coalescer"]["max_running_seen"] <= FC.CAP
    weights = runs["fair_weights.baseline"]
    assert sum(weights["counts"].values()) == fs.fair_weights


def _fair_figures() -> set[str]:
    return figure_names(fairness_rows.rows, Tiny())
