"""A worker's periodic INFO line: refreshes, failures and dead letters since the last
line, logged only when something happened, and once more at close."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from coalescer import Claim, Coalescer
from coalescer.common.metrics import Metrics
from coalescer.worker.summary import RefreshSummary, bound_text, lag_text
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until

LINE = re.compile(r"coalescer (\S+): (\d+) refresh(?:es)? in the last \d+s "
                  r"\((\d+) failed(?:, (\d+) dead-lettered)?\)")

RULES = """\
namespace: {ns}
defaults:
  window: 20ms
  max_wait: 1s
  absorb: 5ms
rules:
  - name: item
    match: "item:{{id}}"
    retry: {{attempts: 1}}
    handler: {mod}:refresh
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def summary_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, int, int]]:
    found = []
    for record in caplog.records:
        if record.name == "coalescer.worker.summary" and record.levelno == logging.INFO:
            match = LINE.match(record.getMessage())
            assert match, record.getMessage()
            node, done, failed, dead = match.groups()
            found.append((node, int(done), int(failed), int(dead or 0)))
    return found


def refresh(metrics: Metrics, outcome: str, lag: float) -> None:
    m = metrics.rule("item")
    m.outcomes[outcome] += 1
    m.start_lag.observe(lag)


def test_one_line_per_period_only_when_something_happened(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer")
    metrics, clock = Metrics(), Clock()
    summary = RefreshSummary("n1", metrics, ["item"], clock=clock)
    for _ in range(3):
        refresh(metrics, "success", 0.003)
    refresh(metrics, "timeout", 0.008)
    summary.tick()
    assert summary_lines(caplog) == []  # the period has not ended
    clock.now += 10
    summary.tick()
    assert summary_lines(caplog) == [("n1", 4, 1, 0)]
    assert caplog.records[-1].getMessage() == (
        "coalescer n1: 4 refreshes in the last 10s (1 failed), "
        "start lag p50 <=5 ms, max <=10 ms")
    clock.now += 10
    summary.tick()  # nothing since the last line: no line
    assert len(summary_lines(caplog)) == 1


def test_the_final_tick_reports_what_is_left_and_counts_dead_letters(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer")
    metrics, clock = Metrics(), Clock()
    summary = RefreshSummary("n1", metrics, ["item"], clock=clock)
    summary.tick(final=True)
    assert summary_lines(caplog) == []  # nothing happened: nothing to report
    refresh(metrics, "failure", 0.0)
    metrics.rule("item").dead_lettered += 1
    clock.now += 1
    summary.tick(final=True)
    assert summary_lines(caplog) == [("n1", 1, 1, 1)]


def test_lag_bounds_read_as_milliseconds_or_seconds() -> None:
    bounds = [b for b, _ in Metrics().rule("x").start_lag.buckets()]
    assert bound_text("0.002") == "<=2 ms"
    assert bound_text("2.5") == "<=2.5 s"
    assert bound_text("+Inf") == ">10 s"
    only_slow = [0] * len(bounds)
    only_slow[-1] = 2
    assert lag_text(only_slow, bounds) == ", start lag p50 >10 s, max >10 s"
    assert lag_text([0] * len(bounds), bounds) == ""


async def test_a_worker_reports_its_refreshes_by_close(
        tmp_path: Path, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer")
    rules, rec = recorder_rules(tmp_path, f"summary_{namespace}", RULES.format(
        ns=namespace, mod=f"summary_{namespace}"))

    async def hook(claim: Claim) -> None:
        if claim.key == "item:bad":
            raise RuntimeError("db down")

    rec.hook = hook
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=1) as c:
        c.touch_many(["item:1", "item:2", "item:3", "item:bad"])
        await c.flush()
        await wait_until(lambda: len(rec.calls) == 4, message="every key refreshed")
        await wait_until(
            lambda: sum(m.outcomes["failure"] for m in [c.metrics.rule("item")]) == 1,
            message="the failure counted")
    lines = summary_lines(caplog)
    assert {node for node, *_ in lines} == {"n1"}
    # One line at close, or more had a period ended meanwhile: the counts add up.
    assert [sum(col) for col in list(zip(*lines, strict=True))[1:]] == [4, 1, 1]


def test_the_line_counts_keys_waiting_for_their_rule_rate(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer")
    metrics, clock = Metrics(), Clock()
    summary = RefreshSummary("n1", metrics, ["item"], clock=clock)
    metrics.hold("item", 0, 30)
    metrics.hold("item", 3, 12)
    refresh(metrics, "success", 0.8)
    clock.now += 10
    summary.tick()
    assert caplog.records[-1].getMessage() == (
        "coalescer n1: 1 refresh in the last 10s (0 failed), "
        "start lag p50 <=1 s, max <=1 s, 42 keys waiting for their rule's rate")
    assert metrics.registry.get_sample_value("coalescer_rate_held_keys",
                                             {"rule": "item"}) == 42
    metrics.hold("item", 0, 0)
    metrics.hold("item", 3, 0)
    refresh(metrics, "success", 0.003)
    clock.now += 10
    summary.tick()
    assert caplog.records[-1].getMessage().endswith("max <=5 ms")
    assert metrics.held_by_rate() == 0
