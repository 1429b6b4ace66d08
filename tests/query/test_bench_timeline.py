"""The timeline benchmark (bench/timeline.py) run end to end at a tiny size through
bench.run's own group and table, so it cannot rot: both columns answer on a real server
with every key pending, the key's timeline is full, and every row gets a figure. The
timings are the bench's, not asserted here; only counts are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import common as C
from bench import run as R
from coalescer.query.timeline_events import EVENTS


def tiny() -> C.Sizes:
    sizes = C.Sizes(million=300)  # the keys pending
    sizes.timeline_calls = 5  # type: ignore[attr-defined]
    return sizes


async def test_the_timeline_group_runs_and_fills_its_rows(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    await R.run_group("timeline", tiny(), tmp_path, results, 1)
    timeline = results["timeline"]["coalescer"]["runs"][0]
    explain = results["timeline"]["baseline"]["runs"][0]
    assert "error" not in timeline and "error" not in explain, (timeline, explain)
    for run in (timeline, explain):
        assert run["pending"] == 299 and run["calls"] == 5
        assert run["events"] == EVENTS + 1  # the last 32 re-schedules, and its touch
        assert run["timeline_bytes"] > 0
    rows = [r for r in R.rows(results, tiny()) if "timeline" in r["figure"]]
    assert len(rows) == 3
    assert all(r["coalescer"] != "n/a" for r in rows)
