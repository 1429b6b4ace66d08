"""The refresh figures a node counts per refresh, as /metrics exports them."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from coalescer.common.metrics import Metrics


def sample(m: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    m = Metrics()
    lag = m.rule("stats").start_lag
    for seconds in (0.0, 0.001, 0.0011, 0.5, 99.0):
        lag.observe(seconds)
    name = "coalescer_refresh_start_lag_seconds_bucket"
    assert sample(m, name, {"rule": "stats", "le": "0.001"}) == 2
    assert sample(m, name, {"rule": "stats", "le": "0.002"}) == 3
    assert sample(m, name, {"rule": "stats", "le": "0.5"}) == 4
    assert sample(m, name, {"rule": "stats", "le": "10.0"}) == 4
    assert sample(m, name, {"rule": "stats", "le": "+Inf"}) == 5
    assert sample(m, "coalescer_refresh_start_lag_seconds_count", {"rule": "stats"}) == 5
    total = sample(m, "coalescer_refresh_start_lag_seconds_sum", {"rule": "stats"})
    assert total == pytest.approx(99.5021)


def test_outcomes_are_counted_per_rule() -> None:
    m = Metrics()
    m.rule("a").outcomes["success"] += 3
    m.rule("b").outcomes["timeout"] += 1
    assert sample(m, "coalescer_refreshes_total", {"rule": "a", "outcome": "success"}) == 3
    assert sample(m, "coalescer_refreshes_total", {"rule": "a", "outcome": "failure"}) == 0
    assert sample(m, "coalescer_refreshes_total", {"rule": "b", "outcome": "timeout"}) == 1


def test_the_exposition_lists_the_refresh_families_once_a_rule_has_run() -> None:
    m = Metrics()
    assert b"coalescer_refreshes_total{" not in generate_latest(m.registry)
    m.rule("stats").duration.observe(0.25)
    text = generate_latest(m.registry).decode()
    assert 'coalescer_refreshes_total{outcome="success",rule="stats"} 0.0' in text
    assert 'coalescer_refresh_duration_seconds_bucket{le="0.25",rule="stats"} 1.0' in text
    assert m.start_lag_buckets()["+Inf"] == 0
