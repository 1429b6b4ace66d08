"""Prometheus metrics of one coalescer, in a registry of its own."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OUTCOMES = ("success", "failure", "timeout")
_BATCH_BUCKETS = (1, 2, 5, 10, 50, 100, 500, 1000, 5000, 10000)
_BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000,
                                          5000, 10000)
# Seconds from a burst's touches to its refresh: windows run from milliseconds to hours.
_TOUCH_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
                      900.0, 3600.0)


@dataclass(slots=True)
class Tally:
    """A histogram's counts as plain numbers: observing one is a bisect and two adds
    (a prometheus_client Histogram takes a lock per bucket and per sum, which cost
    more than a no-op refresh itself). Read only when /metrics is scraped."""

    bounds: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts per upper bound, as the exposition format lists them."""
        out, running = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class RuleMetrics:
    """One rule's refresh figures, counted per refresh without locks."""

    start_lag: Tally = field(default_factory=Tally)
    duration: Tally = field(default_factory=Tally)
    # Keys per handler call of a batch rule (empty for the others).
    batch_size: Tally = field(default_factory=lambda: Tally(_BATCH_SIZE_BUCKETS))
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    dead_lettered: int = 0  # keys whose last attempt failed (for the worker's summary line)
    # First tries only: touches of the burst, and its first and last touch to the start.
    touches: Tally = field(default_factory=lambda: Tally(_BATCH_SIZE_BUCKETS))
    first_touch_lag: Tally = field(default_factory=lambda: Tally(_TOUCH_LAG_BUCKETS))
    last_touch_lag: Tally = field(default_factory=lambda: Tally(_TOUCH_LAG_BUCKETS))
    forced_by_max_wait: int = 0  # first tries due at first touch + max_wait, not the window
    reruns: int = 0  # successes whose key was touched while they ran (it runs again)


class RefreshCollector:
    """Exports every rule's RuleMetrics as coalescer_refreshes_total, the duration
    and start-lag histograms, and the coalescing figures."""

    def __init__(self, rules: dict[str, RuleMetrics]) -> None:
        self._rules = rules

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families())

    def _families(self) -> list[Metric]:
        done = CounterMetricFamily("coalescer_refreshes",
                                   "refreshes finished, by rule and outcome",
                                   labels=["rule", "outcome"])
        duration = HistogramMetricFamily("coalescer_refresh_duration_seconds",
                                         "handler run time", labels=["rule"])
        lag = HistogramMetricFamily("coalescer_refresh_start_lag_seconds",
                                    "refresh start minus due time", labels=["rule"])
        sizes = HistogramMetricFamily("coalescer_batch_size",
                                      "keys per handler call of a batch rule", labels=["rule"])
        for name, m in list(self._rules.items()):
            for outcome, n in m.outcomes.items():
                done.add_metric([name, outcome], n)
            duration.add_metric([name], m.duration.buckets(), m.duration.total)
            lag.add_metric([name], m.start_lag.buckets(), m.start_lag.total)
            if m.batch_size.total:
                sizes.add_metric([name], m.batch_size.buckets(), m.batch_size.total)
        return [done, duration, lag, sizes, *_coalescing(self._rules)]


def _coalescing(rules: dict[str, RuleMetrics]) -> list[Metric]:
    """How much each rule coalesces: touches per refresh, lags from the touches, runs
    forced by max_wait, reruns."""
    touches = HistogramMetricFamily(
        "coalescer_refresh_touches",
        "touches of the burst a refresh ran for (first tries; a touch counts once per "
        "write to Redis)", labels=["rule"])
    first = HistogramMetricFamily("coalescer_refresh_first_touch_lag_seconds",
                                  "refresh start minus the burst's first touch (first tries)",
                                  labels=["rule"])
    last = HistogramMetricFamily("coalescer_refresh_last_touch_lag_seconds",
                                 "refresh start minus the burst's last touch (first tries)",
                                 labels=["rule"])
    forced = CounterMetricFamily(
        "coalescer_refreshes_forced_by_max_wait",
        "refreshes due at the burst's first touch plus max_wait while touches kept "
        "coming (the quiet window never came)", labels=["rule"])
    reruns = CounterMetricFamily(
        "coalescer_reruns", "successful refreshes whose key was touched while they ran, "
        "so it runs again", labels=["rule"])
    for name, m in list(rules.items()):
        touches.add_metric([name], m.touches.buckets(), m.touches.total)
        first.add_metric([name], m.first_touch_lag.buckets(), m.first_touch_lag.total)
        last.add_metric([name], m.last_touch_lag.buckets(), m.last_touch_lag.total)
        forced.add_metric([name], m.forced_by_max_wait)
        reruns.add_metric([name], m.reruns)
    return [touches, first, last, forced, reruns]


class Metrics:
    """Every metric coalescer exports; ``registry`` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.touches = Counter("coalescer_touches_total", "touch() calls accepted", registry=r)
        self.absorbed = Counter(
            "coalescer_absorbed_touches_total",
            "touches absorbed in process (no Redis I/O of their own)", registry=r)
        self.touch_waits = Counter(
            "coalescer_touch_waits_total",
            "times a waiting touch (touch_wait, touch_many_wait) found the buffer full "
            "and waited for room", registry=r)
        self.flusher_waits = Counter(
            "coalescer_touch_flusher_waits_total",
            "touches that paused (5 ms at most) for the background writer to take the "
            "keys piled up since its last batch", registry=r)
        self.flushes = Counter("coalescer_flushes_total", "batches written to Redis", registry=r)
        self.flush_keys = Histogram(
            "coalescer_flush_batch_keys", "keys per batch written to Redis",
            buckets=_BATCH_BUCKETS, registry=r)
        self._rules: dict[str, RuleMetrics] = {}
        r.register(RefreshCollector(self._rules))
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
        self.node_unhealthy = Gauge(
            "coalescer_node_unhealthy",
            "1 while this node's recent refreshes fail as a whole (at least 90% of them, "
            "of at least 5 distinct keys): it gives its shards up to a healthy node when "
            "one can take them", registry=r)
        self.shards_given_up = Counter(
            "coalescer_shards_given_up_total",
            "shards this node handed to another node because its refreshes failed",
            registry=r)
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
        self.refused_writes = Counter(
            "coalescer_redis_refused_writes_total",
            "writes of touches Redis answered with an error reply that is not about a key "
            "(MISCONF, READONLY, OOM, NOPERM, ...; the touches stay buffered and are "
            "retried), by the reply's code", ["code"], registry=r)
        self.refusing_writes = Gauge(
            "coalescer_redis_refusing_writes",
            "1 while Redis refuses this process's writes (since the last refused write, "
            "until one is taken)", registry=r)
        self.evicting = Gauge(
            "coalescer_redis_evicting_policy",
            "1 while a Redis server's maxmemory-policy may evict coalescer's keys "
            "(allkeys-*), as last checked", registry=r)
        self.durability_unmet = Gauge(
            "coalescer_durability_unmet",
            "1 while fewer replicas than durability.replicas acknowledge this process's "
            "writes (nothing is written or claimed meanwhile), else 0", registry=r)
        self.cancels = Counter(
            "coalescer_cancels_total",
            "keys whose pending refresh (or re-arm) a cancel dropped, by rule", ["rule"],
            registry=r)
        self.reshard_moved = Counter(
            "coalescer_reshard_moved_keys_total",
            "keys this node's mover moved to their new shard during a reshard", registry=r)
        self.source_entries = Counter(
            "coalescer_source_entries_total",
            "source entries (stream entries, outbox rows) handled, by source and outcome "
            "(accepted, rejected)", ["source", "outcome"], registry=r)
        self.outbox_backlog = Gauge(
            "coalescer_outbox_backlog_rows",
            "rows waiting in an outbox source's table, as this node last counted them "
            "(counted up to a cap)", ["source"], registry=r)
        self.outbox_lag = Gauge(
            "coalescer_outbox_lag_seconds",
            "age of the oldest row waiting in an outbox source's table (0 when empty)",
            ["source"], registry=r)
        self.outbox_errors = Counter(
            "coalescer_outbox_errors_total",
            "failed claims of an outbox source (database or Redis errors); the rows wait",
            ["source"], registry=r)
        self.kafka_lag = Gauge(
            "coalescer_kafka_lag_messages",
            "messages of a Kafka partition not yet committed by this node's consumer group "
            "(end offset less committed offset), for the partitions this node reads",
            ["source", "topic", "partition"], registry=r)
        self.kafka_unflushed = Gauge(
            "coalescer_kafka_unflushed_messages",
            "messages of a Kafka source this node has read and not yet flushed and "
            "committed (at most the source's batch)", ["source"], registry=r)
        self.kafka_unflushed_peak = Gauge(
            "coalescer_kafka_unflushed_peak_messages",
            "the most messages of a Kafka source this node held read and not yet flushed "
            "at once, since it started", ["source"], registry=r)
        self.kafka_errors = Counter(
            "coalescer_kafka_errors_total",
            "failed steps of a Kafka source (broker unreachable, a commit or flush that "
            "failed); the messages are read again", ["source"], registry=r)

        self.item_overflows = Counter(
            "coalescer_item_overflows_total",
            "claims handed to a handler with items_overflowed (more distinct items were "
            "touched than the rule's items max; every try counts), by rule", ["rule"],
            registry=r)
        self.rate_held = Gauge(
            "coalescer_rate_held_keys",
            "due keys held back by their rule's rate on the shards this node leads "
            "(their start lag grows while they wait)", ["rule"], registry=r)
        self.rate_waits = Counter(
            "coalescer_rate_waits_total",
            "times a shard's poller found its rule's rate used up and waited", ["rule"],
            registry=r)
        self._held: dict[str, dict[int, int]] = {}  # rule -> shard -> keys held by its rate
        self.http_connections = Gauge(
            "coalescer_http_connections", "connections open on the HTTP API", registry=r)
        self.http_connections_max = Gauge(
            "coalescer_http_connections_max",
            "the HTTP API's connection cap (--http-max-connections, else from the file "
            "limit)", registry=r)
        self.http_cut_off = Counter(
            "coalescer_http_connections_closed_total",
            "HTTP API connections closed or turned away by its limits, by reason: "
            "evicted (idle or unfinished, closed to make room at the cap), refused (over "
            "the cap, every slot busy), header_timeout, body_timeout, busy (503: too many "
            "requests running), accept_failed (accept() out of file descriptors)",
            ["reason"], registry=r)
        self.quota_refusals = Counter(
            "coalescer_quota_refusals_total",
            "touches refused because the pending keys reached limits.pending_keys",
            registry=r)
        self.dead_letters_dropped = Counter(
            "coalescer_dead_letters_dropped_total",
            "dead letters dropped by this node, by reason: age (older than "
            "limits.dead_letter_ttl) or count (past limits.dead_letters, oldest first)",
            ["reason"], registry=r)
        self.unwritten_age = Gauge(
            "coalescer_oldest_unwritten_touch_seconds",
            "age of the oldest touch buffered in this process and not yet written to Redis "
            "(0 when every touch is written), as of the scrape", registry=r)
        self.rule_paused = Gauge(
            "coalescer_rule_paused",
            "1 while an operator has paused the rule (its keys collect touches and no "
            "node runs them), else 0, as this worker node last read it", ["rule"],
            registry=r)
        fair = ("per group of a fair rule: the top groups by backlog as status shows "
                "them, the rest summed in group=\"(other)\", as of the scrape")
        self.fair_backlog = Gauge(
            "coalescer_fair_backlog_keys", f"due keys waiting, {fair}", ["rule", "group"],
            registry=r)
        self.fair_share = Gauge(
            "coalescer_fair_share", f"share of the claims while backlogged, {fair}",
            ["rule", "group"], registry=r)
        self.fair_running = Gauge(
            "coalescer_fair_running", f"keys in flight (what max_running caps), {fair}",
            ["rule", "group"], registry=r)

    def hold(self, rule: str, shard: int, keys: int) -> None:
        """Shard ``shard`` holds ``keys`` due keys of ``rule`` back for its rate."""
        shards = self._held.setdefault(rule, {})
        if shards.get(shard, 0) == keys:
            return
        if keys:
            shards[shard] = keys
        else:
            shards.pop(shard, None)
        self.rate_held.labels(rule).set(sum(shards.values()))

    def held_by_rate(self) -> int:
        """Due keys held back by their rules' rates now, every rule and shard."""
        return sum(sum(shards.values()) for shards in list(self._held.values()))

    def start_lag_buckets(self) -> dict[str, int]:
        """Start lags of every rule: cumulative counts per bucket bound ("+Inf" last)."""
        out: dict[str, int] = {}
        for m in list(self._rules.values()):
            for bound, n in m.start_lag.buckets():
                out[bound] = out.get(bound, 0) + n
        return out

    def rule(self, name: str) -> RuleMetrics:
        """The metrics of rule ``name``."""
        found = self._rules.get(name)
        if found is None:
            found = self._rules[name] = RuleMetrics()
        return found
