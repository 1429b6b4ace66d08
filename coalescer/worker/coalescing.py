"""What a refresh's start says about its burst: the coalescing figures of RuleMetrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coalescer.claim import Claim
    from coalescer.common.metrics import RuleMetrics
    from coalescer.config.rules import Rule


def forced_by_max_wait(rule: Rule, claim: Claim) -> bool:
    """Whether a first try was due at its burst's first touch plus ``max_wait`` while
    its last touch's window ran past that: touches kept coming and the cap ran it."""
    cap = claim.first_touch_ms + round(rule.max_wait * 1000)
    return (claim.attempt == 1 and claim.due_ms == cap
            and claim.last_touch_ms + round(rule.window * 1000) > cap)


def observe_start(m: RuleMetrics, rule: Rule, claim: Claim, touches: int,
                  server_now: float) -> None:
    """Count a refresh starting at ``server_now`` (server clock, ms) for ``claim``, whose
    burst had ``touches`` touches. A retry counts in the start lag only: its burst was
    counted by its first try."""
    lag = (server_now - claim.due_ms) / 1000
    m.start_lag.observe(lag if lag > 0.0 else 0.0)
    if claim.attempt != 1:
        return
    m.touches.observe(touches)
    m.first_touch_lag.observe(max(0.0, (server_now - claim.first_touch_ms) / 1000))
    m.last_touch_lag.observe(max(0.0, (server_now - claim.last_touch_ms) / 1000))
    if forced_by_max_wait(rule, claim):
        m.forced_by_max_wait += 1
