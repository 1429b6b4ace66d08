"""The rules registry: which rules each live worker node knows (rolling deploys).

Every worker node records its rules, each as its name and a fingerprint of its
settings, in each shard's registry with every call for that shard's leadership
(``acquire.lua``); an entry counts while its node is in the shard's node set, which
it leaves when it shuts down, or when a live node finds its node lease lapsed
(``node_lease.py``), so a dead node's rules drop out within about a leader lease. The scripts
read it to serve a rule that a shard's leader lacks (``adopt.lua``); this module
encodes entries, compares them and, whenever the number of live nodes
changes (and every 60 s), reads the registry and warns (once per rule) and counts when this
node lacks a rule some live node knows, or knows it with other settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coalescer.common.retrying import Backoff, keep_running
from coalescer.config.rules import Rule
from coalescer.store.script_types import Peer

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger(__name__)

# Registry reads (one script call each) follow changes in the live-node count, which
# every node lease call reports; this slow period only catches a node that came
# back under the same id with other rules. An idle node's extra cost: 1/60 command/s.
CHECK_INTERVAL = 60.0
# A node is counted live (its node lease) a moment before its rules reach the registry
# (its first shard call): a read that finds fewer entries than live nodes reads again
# this soon, a few times at most.
SOON = 0.5
SOON_TRIES = 10


def fingerprint(rule: Rule) -> str:
    """12 hex digits that change with the rule's match, timing, retries, handler, rate,
    batch or items (a rule without ``rate:``, ``batch:`` or ``items:`` keeps the
    fingerprint it had before they existed)."""
    retry = rule.retry
    parts: tuple[str, ...] = (
        rule.pattern.source, repr(rule.window), repr(rule.max_wait), repr(rule.timeout),
        f"{retry.attempts}/{retry.backoff!r}/{retry.max_backoff!r}",
        rule.handler_ref if callable(rule.handler) else repr(rule.handler))
    if rule.rate is not None:  # only then: a rule without one keeps its fingerprint
        parts += (f"rate {rule.rate}",)
    if rule.batch is not None:
        parts += (f"batch {rule.batch.max}/{rule.batch.wait!r}",)
    if rule.items is not None:
        parts += (f"items {rule.items.max}",)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def encode(rules: Iterable[Rule]) -> str:
    """A node's registry entry: ``|NAME=FP|NAME=FP|`` (names hold no '|' or '=')."""
    return "|" + "".join(f"{r.name}={fingerprint(r)}|" for r in rules)


def decode(entry: str) -> dict[str, str]:
    """Rule name -> fingerprint of a registry entry."""
    out = {}
    for item in entry.split("|"):
        name, _, fp = item.partition("=")
        if name:
            out[name] = fp
    return out


@dataclass(slots=True)
class Mismatch:
    """How the live nodes' rules differ: rules not known everywhere, or differently."""

    missing: dict[str, list[str]] = field(default_factory=dict)  # rule -> nodes lacking it
    differing: dict[str, dict[str, str]] = field(default_factory=dict)  # rule -> node -> fp

    @property
    def any(self) -> bool:
        return bool(self.missing or self.differing)


def compare(nodes: dict[str, dict[str, str]]) -> Mismatch:
    """The mismatches among ``nodes`` (node -> rule name -> fingerprint)."""
    out = Mismatch()
    for name in sorted({n for rules in nodes.values() for n in rules}):
        lacking = sorted(node for node, rules in nodes.items() if name not in rules)
        if lacking:
            out.missing[name] = lacking
        fps = {node: rules[name] for node, rules in nodes.items() if name in rules}
        if len(set(fps.values())) > 1:
            out.differing[name] = dict(sorted(fps.items()))
    return out


class RegistryWatch:
    """Reads shard 0's registry now and then; warns and counts what this node lacks."""

    def __init__(self, ctx: NodeContext) -> None:
        self._shard = ctx.keyspace.shard(0)
        self._scripts = ctx.scripts
        self._node_id = ctx.node_id
        self._mine = {r.name: fingerprint(r) for r in ctx.rules}
        self.entry = encode(ctx.rules)  # this node's entry, sent with every lease call
        self._live_ms = round(2 * ctx.leader_lease * 1000)
        self._metrics = ctx.metrics
        self._missing: set[str] = set()
        self._differing: set[tuple[str, str, str]] = set()
        self._live = 0
        self._soon = 0  # quick reads left while some live node has no entry yet
        self._changed = asyncio.Event()

    def nudge(self, live_nodes: int) -> None:
        """A node lease call counted ``live_nodes``: read the registry if that changed."""
        if live_nodes != self._live:
            self._live = live_nodes
            self._soon = SOON_TRIES
            self._changed.set()

    async def run(self) -> None:
        """The background loop: survives Redis errors, logs once, backs off."""
        await self._wait(CHECK_INTERVAL)
        await keep_running("rules registry read", self.check,
                           backoff=Backoff(base=1.0, cap=CHECK_INTERVAL), logger=log,
                           on_error=lambda _: self._metrics.redis_errors.labels(
                               "registry").inc(),
                           pause=self._wait, rest=self._rest)

    async def _rest(self) -> None:
        await self._wait(SOON if self._soon else CHECK_INTERVAL)

    async def _wait(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less if the count of live nodes changed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), delay)
        self._changed.clear()

    async def check(self) -> None:
        """Read the registry once; warn about new mismatches, update the gauges."""
        _, peers = await self._scripts.peers(self._shard, self._live_ms)
        self._soon = self._soon - 1 if self._soon and len(peers) < self._live else 0
        others = [p for p in peers if p.node != self._node_id]
        self._note_missing(others)
        self._note_differing(others)

    def _note_missing(self, others: list[Peer]) -> None:
        knowers: dict[str, list[str]] = {}
        for peer in others:
            for name in decode(peer.rules):
                if name not in self._mine:
                    knowers.setdefault(name, []).append(peer.node)
        for name in sorted(knowers.keys() - self._missing):
            log.warning("node %s lacks rule %r, which live %s %s know: those nodes serve "
                        "its keys; deploy one rules file to every node", self._node_id, name,
                        "node" if len(knowers[name]) == 1 else "nodes",
                        ", ".join(sorted(knowers[name])))
        for name in self._missing | knowers.keys():
            self._metrics.rules_missing.labels(name).set(1 if name in knowers else 0)
        self._missing = set(knowers)

    def _note_differing(self, others: list[Peer]) -> None:
        found = {(name, peer.node, fp) for peer in others
                 for name, fp in decode(peer.rules).items()
                 if name in self._mine and fp != self._mine[name]}
        for name, node, fp in sorted(found - self._differing):
            log.warning("rule %r differs between nodes: fingerprint %s here on %s, %s on %s; "
                        "each node serves it with its own settings", name, self._mine[name],
                        self._node_id, fp, node)
        names = {f[0] for f in found}
        for name in {f[0] for f in self._differing} | names:
            self._metrics.rules_differing.labels(name).set(1 if name in names else 0)
        self._differing = found
