"""The whole-import cost bench (bench/fair_drain_cost.py) at a tiny size on real
servers, so it cannot rot: each side's run drains the import and reads the server's
command usage, and the report names the scripts' time per key of both sides."""

from __future__ import annotations

import pytest

from bench import common as C
from bench import fair_drain_cost as cost
from bench import fairness as FR


class Tiny(C.Sizes):
    fair = FR.FairSizes.tiny()


@pytest.mark.slow  # two import runs of a few seconds each
async def test_each_side_drains_and_reports_its_redis_time_by_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    found = await cost.measure(1, Tiny())

    assert {side: len(runs) for side, runs in found.items()} == {True: 1, False: 1}
    for runs in found.values():
        drain, usage = runs[0]
        assert drain > 0 and usage["evalsha"][0] > 0 and usage["evalsha"][1] > 0
    assert "zpopmin" not in found[False][0][1]  # the plain side never reads a queue
    cost.report(FR.FairSizes.tiny().fair_import, found)
    printed = capsys.readouterr().out
    assert printed.count("fair on :") == 1 and printed.count("fair off:") == 1
    assert "evalsha" in printed
