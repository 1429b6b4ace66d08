"""Prometheus metrics of one coalescer, in a registry of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OUTCOMES = ("success", "failure", "timeout")
_BATCH_BUCKETS = (1, 2, 5, 10, 50, 100, 500, 1000, 5000, 10000)


@dataclass(frozen=True, slots=True)
class RuleMetrics:
    """One rule's label children, resolved once (``labels()`` is too slow per refresh)."""

    start_lag: Any
    duration: Any
    outcomes: dict[str, Any]


class Metrics:
    """Every metric coalescer exports; ``registry`` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.touches = Counter("coalescer_touches_total", "touch() calls accepted", registry=r)
        self.absorbed = Counter(
            "coalescer_absorbed_touches_total",
            "touches absorbed in process (no Redis I/O of their own)", registry=r)
        self.flushes = Counter("coalescer_flushes_total", "batches written to Redis", registry=r)
        self.flush_keys = Histogram(
            "coalescer_flush_batch_keys", "keys per batch written to Redis",
            buckets=_BATCH_BUCKETS, registry=r)
        self.refreshes = Counter(
            "coalescer_refreshes_total", "refreshes finished, by rule and outcome",
            ["rule", "outcome"], registry=r)
        self.duration = Histogram(
            "coalescer_refresh_duration_seconds", "handler run time", ["rule"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.start_lag = Histogram(
            "coalescer_refresh_start_lag_seconds", "refresh start minus due time", ["rule"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.pending = Gauge("coalescer_pending_keys", "keys waiting for their due time",
                             ["rule"], registry=r)
        self.in_flight = Gauge("coalescer_in_flight_keys", "keys claimed and refreshing",
                               ["rule"], registry=r)
        self.dead = Gauge("coalescer_dead_keys", "dead-lettered keys", ["rule"], registry=r)
        self.leader = Gauge("coalescer_shard_leader",
                            "1 where this node leads the shard, else 0", ["shard"], registry=r)
        self.buffered = Gauge("coalescer_buffered_keys",
                              "touched keys buffered in process, not yet in Redis", registry=r)
        self.redis_errors = Counter("coalescer_redis_errors_total",
                                    "Redis errors met by background loops", ["loop"], registry=r)
        self.rules_missing = Gauge(
            "coalescer_rules_missing",
            "1 while a live node knows a rule this node lacks (its keys are served there)",
            ["rule"], registry=r)
        self.rules_differing = Gauge(
            "coalescer_rules_differing",
            "1 while a live node has this rule with other settings (another fingerprint)",
            ["rule"], registry=r)
        self.dropped_keys = Counter(
            "coalescer_dropped_keys_total",
            "touched keys dropped because Redis refused them for good, by reason",
            ["reason"], registry=r)
        self.source_entries = Counter(
            "coalescer_source_entries_total",
            "stream source entries handled, by source and outcome (accepted, rejected)",
            ["source", "outcome"], registry=r)

        self._rules: dict[str, RuleMetrics] = {}

    def rule(self, name: str) -> RuleMetrics:
        """The metrics of rule ``name``."""
        found = self._rules.get(name)
        if found is None:
            outcomes = {o: self.refreshes.labels(name, o) for o in OUTCOMES}
            found = RuleMetrics(self.start_lag.labels(name), self.duration.labels(name), outcomes)
            self._rules[name] = found
        return found
