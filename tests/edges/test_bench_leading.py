"""The leading-edge benchmark (bench/leading_edge.py) run end to end at a tiny size
through bench.run's own group and table, so it cannot rot: both columns run on a real
server, every burst is refreshed, none is lost, and every row gets a figure. The
timings are the bench's, not asserted here; only counts are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import common as C
from bench import run as R


class Tiny(C.Sizes):
    leading_bursts = 12


async def test_the_leading_group_runs_and_fills_its_rows(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    await R.run_group("leading", Tiny(), tmp_path, results, 1)
    leading = results["leading"]["coalescer"]["runs"][0]
    trailing = results["leading"]["baseline"]["runs"][0]
    assert "error" not in leading and "error" not in trailing, (leading, trailing)
    for run in (leading, trailing):
        assert run["bursts"] == run["n"] == 12
        assert run["lost"] == 0
    assert trailing["runs_max"] == 1  # one trailing refresh per burst
    assert leading["runs_max"] <= 2  # the leading one, and one for the touches after it
    rows = [r for r in R.rows(results, Tiny()) if r["figure"].startswith("edge: leading")]
    assert len(rows) == 5
    assert all(r["coalescer"] != "n/a" and r["baseline"] != "n/a" for r in rows)
