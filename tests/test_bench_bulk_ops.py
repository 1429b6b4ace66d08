"""The operator's-reach benchmark (bench/bulk_ops.py) run end to end at a tiny size
through bench.run's own groups and table, so it cannot rot: the search walks every
pending key and finds the matching ones, the bulk retry re-queues every dead key while
the other rule's refreshes run, and every row of the table gets a figure. The figures
themselves (timings) are the bench's, not asserted here; only counts are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import bulk_ops as BO
from bench import common as C
from bench import run as R


class Tiny(C.Sizes):
    bulk_ops = BO.BulkSizes.tiny()


async def test_both_groups_run_and_fill_their_rows(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    for group in ("bulk_ops_search", "bulk_ops_retry"):
        await R.run_group(group, Tiny(), tmp_path, results, 1)
    search = results["bulk_ops_search"]["coalescer"]["runs"][0]
    retry = results["bulk_ops_retry"]["coalescer"]["runs"][0]
    assert "error" not in search and "error" not in retry, (search, retry)
    tiny = BO.BulkSizes.tiny()
    assert (search["examined"], search["found"]) == (tiny.pending, tiny.pending // 1000)
    assert search["server_usec"] > 0
    assert (retry["done"], retry["left_dead"]) == (tiny.dead, 0)
    assert retry["tick_lag"]["n"] > 0
    figures = [r for r in R.rows(results, Tiny()) if r["figure"].startswith(
        ("keys --where", "bulk retry of", "another rule's start lag p99 while"))]
    assert len(figures) == 3 and all(r["coalescer"] != "n/a" for r in figures), figures
