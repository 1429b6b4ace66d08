"""What the parts of one worker node share: ``NodeContext``.

In a module of its own, importing none of the parts, so that every part (runner,
pollers, leadership, leases, registry, health, ...) can take the context without
importing the node that builds them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coalescer.common.metrics import Metrics
from coalescer.config.rules import Config, Rule
from coalescer.store.hints import CommandHints
from coalescer.store.keys import KeySpace
from coalescer.store.layout import Layouts
from coalescer.store.scripts import Scripts
from coalescer.worker.lease_clock import ServerClock
from coalescer.worker.paused import PausedRules


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeContext:
    """What the parts of one node share."""

    scripts: Scripts
    keyspace: KeySpace
    metrics: Metrics
    node_id: str
    config: Config
    hints: CommandHints = field(default_factory=CommandHints)  # for commands the log suggests
    layouts: Layouts | None = None  # the namespace's layout (a node's is always given)
    # the server's clock against this node's, shared by its parts (None on a Cluster:
    # each master has a clock of its own, observed per shard)
    clock: ServerClock | None = None
    # the rules an operator paused (a node's: read from Redis; None: none is)
    paused: PausedRules | None = None

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(self.config.rules)

    @property
    def leader_lease(self) -> float:
        return self.config.leader_lease

    @property
    def claim_lease(self) -> float:
        return self.config.claim_lease
