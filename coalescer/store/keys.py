"""Every Redis key and channel coalescer uses, built in this one module.

A deployment's keys all start with its namespace. The keys of shard ``N`` all
carry the hash tag ``{namespace:N}``, so every Lua script touches one Redis
Cluster slot, and a shard lives wholly on one cluster node.

Every key, its type and what it holds is listed in docs/protocol.md (and the data
model in docs/concepts.md); each builder below says what its key is for.

A source's stream and its consumer group are the user's, named in the rules
file, and not built here (in a Redis Cluster the stream lives on its own slot).

The rules registry (which node knows which rules, for rolling deploys) is kept
per shard, next to the shard's node set, rather than under a namespace-wide
key: every worker node heartbeats every shard anyway, so the scripts that
decide who serves a shard's keys read it in their own slot, and no key needs a
tag of its own.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardKeys:
    """The keys of one shard."""

    namespace: str
    shard: int

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:{{{self.namespace}:{self.shard}}}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    @property
    def seq(self) -> str:
        return f"{self.prefix}:seq"

    @property
    def next_wake(self) -> str:
        return f"{self.prefix}:next"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}:nodes"

    @property
    def rules(self) -> str:
        return f"{self.prefix}:rules"

    @property
    def rule_names(self) -> str:
        return f"{self.prefix}:rulenames"

    @property
    def meta(self) -> str:
        return f"{self.prefix}:meta"

    @property
    def wake_channel(self) -> str:
        return f"{self.prefix}:wake"

    @property
    def history(self) -> str:
        return f"{self.prefix}:history"

    @property
    def bytes(self) -> str:
        """The count of bytes the shard holds for its keys (pending_bytes.lua)."""
        return f"{self.prefix}:bytes"

    @property
    def items_prefix(self) -> str:
        """``items(key)`` is this followed by the key (scripts build it so)."""
        return f"{self.prefix}:items:"

    @property
    def claimed_prefix(self) -> str:
        """``claimed_items(key)`` is this followed by the key (scripts build it so)."""
        return f"{self.prefix}:claimed:"

    @property
    def traces_prefix(self) -> str:
        """``traces(key)`` is this followed by the key (scripts build it so)."""
        return f"{self.prefix}:traces:"

    @property
    def quiet_prefix(self) -> str:
        """``quiet(key)`` is this followed by the key (scripts build it so)."""
        return f"{self.prefix}:quiet:"

    @property
    def layout(self) -> str:
        return f"{self.prefix}:layout"

    def fair(self, rule: str) -> str:
        """The prefix of a fair rule's order in this shard (store/lua/_fair.lua): its
        groups' pending keys (``q:GROUP``), the start tags of those with due keys
        (``groups``), the first scores of the others (``heads``), finish tags
        (``tags``), keys to move up when due (``prio``), virtual time and how far the
        index is built (``state``), the runtime weights and cap (``conf``, a copy of
        ``fair_settings``) and, on a Redis Cluster, the groups' runs in flight
        (``run:GROUP``)."""
        return f"{self.prefix}:fair:{rule}:"

    @property
    def fair_specs(self) -> str:
        """Due key of each fair rule -> "PATTERN\\0PREFIX\\0PRIORITY-MS", published by
        its claims for every script that adds to a due set (store/lua/_lib.lua,
        ``fair_specs_key``, names it the same way: the meta hash's name and ":fair")."""
        return f"{self.meta}:fair"

    @property
    def paused(self) -> str:
        """The rules paused, as the claim scripts read them in this shard's slot
        (written by query/controls.py to every shard before a pause returns)."""
        return f"{self.prefix}:paused"

    @property
    def moving(self) -> str:
        return f"{self.prefix}:moving"

    @property
    def arrived(self) -> str:
        return f"{self.prefix}:arrived"

    def items(self, key: str) -> str:
        """The items touched with ``key`` since its last claim. Whatever drops a key's
        state for good (purge.lua, a cancel) deletes this and ``claimed_items(key)``."""
        return self.items_prefix + key

    def claimed_items(self, key: str) -> str:
        """The items of ``key``'s current claim, until a success is acked."""
        return self.claimed_prefix + key

    def traces(self, key: str) -> str:
        """The trace contexts kept for ``key``'s next refresh (tracing on only). Whatever
        drops a key's state (cancel, purge, the dead-letter trim, an ack) deletes it."""
        return self.traces_prefix + key

    def quiet(self, key: str) -> str:
        """The last touch of ``key`` of a rule with ``edge: leading`` (server ms), kept
        for its window (upsert.lua): while it is there the key is not quiet, and its
        next touch starts no leading refresh. Cancel and purge delete it."""
        return self.quiet_prefix + key

    @property
    def timeline_prefix(self) -> str:
        """``timeline(key)`` is this followed by the key (the scripts build it from the
        meta key's prefix, see lua/_lib.lua timeline_of)."""
        return f"{self.prefix}:timeline:"

    def timeline(self, key: str) -> str:
        """``key``'s recent events (lua/_lib.lua): deleted with its state by a cancel,
        a purge or the dead-letter trim; an ack leaves it to expire."""
        return self.timeline_prefix + key

    def acked(self, node: str) -> str:
        """The receipt of ``node``'s last ack call on this shard (see lua/ack.lua)."""
        return f"{self.prefix}:acked:{node}"

    def due(self, rule: str) -> str:
        return f"{self.prefix}:due:{rule}"

    def inflight(self, rule: str) -> str:
        return f"{self.prefix}:inflight:{rule}"

    def dead(self, rule: str) -> str:
        return f"{self.prefix}:dead:{rule}"


def key_hash(key: str) -> int:
    """The hash a key's shard is taken from: stable across processes and restarts."""
    # surrogatepass: a key that cannot be stored still has a shard (its write fails)
    return zlib.crc32(key.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Maps touched keys to shards, and shards to their Redis keys. ``source`` is the
    old shard count while a reshard from it runs (0 otherwise), and ``gen`` the layout
    generation this mapping belongs to (store/layout.py)."""

    namespace: str
    shards: int
    source: int = 0
    gen: int = 1

    def shard_of(self, key: str) -> int:
        """The shard that owns ``key`` once any reshard running now is done."""
        if self.shards == 1:
            return 0
        return key_hash(key) % self.shards

    def source_of(self, key: str) -> int:
        """The shard ``key`` lived in before the running reshard (``shard_of`` if none)."""
        if not self.source:
            return self.shard_of(key)
        return key_hash(key) % self.source

    def homes(self, key: str) -> list[int]:
        """Where ``key``'s state may be now: its old shard, then its new one."""
        old, new = self.source_of(key), self.shard_of(key)
        return [old] if old == new else [old, new]

    @property
    def resharding(self) -> bool:
        return self.source > 0

    @property
    def span(self) -> int:
        """How many shards hold keys now: both counts' while a reshard runs."""
        return max(self.shards, self.source)

    def shard(self, n: int) -> ShardKeys:
        return ShardKeys(self.namespace, n)

    def all_shards(self) -> list[ShardKeys]:
        return [self.shard(n) for n in range(self.span)]


def node_leases(namespace: str) -> str:
    """The worker nodes' leases (node_lease.lua): one per node, whatever the shard count."""
    return f"{namespace}:{{{namespace}:nodes}}:leases"


def benched(namespace: str) -> str:
    """The nodes that gave their shards up for a cool-off (bench.lua), next to the node
    leases: the bench call reads both in one slot."""
    return f"{namespace}:{{{namespace}:nodes}}:benched"


def layout(namespace: str) -> str:
    """The namespace's shard layout (store/layout.py), next to the node leases: the
    node lease call reads its generation in the same slot."""
    return f"{namespace}:{{{namespace}:nodes}}:layout"


def layout_channel(namespace: str) -> str:
    """Where a change of the layout is announced (a reshard began, an old shard was
    drained, it ended): worker nodes read the layout again when they hear of it."""
    return f"{namespace}:{{{namespace}:nodes}}:layout-changed"


def nodes_channel(namespace: str) -> str:
    """Where a worker node announces that it joined (its first lease) or left: the
    others read the leases at once and share the shards again."""
    return f"{namespace}:{{{namespace}:nodes}}:nodes-changed"


def drained(namespace: str) -> str:
    """The old shards a running reshard has emptied (the layout's tag)."""
    return f"{namespace}:{{{namespace}:nodes}}:drained"


def sources_rejected(namespace: str) -> str:
    """The hash counting each stream source's rejected entries (its own hash tag)."""
    return f"{namespace}:{{{namespace}:sources}}:rejected"


def sources_outbox(namespace: str) -> str:
    """The hash of what each node last saw of each outbox source (the sources' tag)."""
    return f"{namespace}:{{{namespace}:sources}}:outbox"


def sources_kafka(namespace: str) -> str:
    """The hash of what the nodes last saw of each Kafka source: each partition's lag,
    each node's error (the sources' tag)."""
    return f"{namespace}:{{{namespace}:sources}}:kafka"


def rate_bucket(namespace: str, rule: str) -> str:
    """The token bucket of ``rule``'s rate: cluster-wide, so on a slot of its own (the
    rule's keys span every shard), one per rule so that rules spread over the cluster."""
    return f"{namespace}:{{{namespace}:rate:{rule}}}:bucket"


def fair_settings(namespace: str, rule: str) -> str:
    """A fair rule's weights and cap set at runtime (HASH "w:VALUE" -> weight, "cap" ->
    max_running), copied to every shard's ``ShardKeys.fair(rule) + "conf"``, which the
    claim script reads (store/fair_settings.py)."""
    return f"{namespace}:{{{namespace}:fair}}:conf:{rule}"


def fair_settings_rules(namespace: str) -> str:
    """The rules that have runtime weights or a cap (SET): what a reshard copies to its
    new shards."""
    return f"{namespace}:{{{namespace}:fair}}:conf-rules"


def fair_runs(namespace: str, rule: str) -> str:
    """The prefix of a fair rule's runs in flight per group (HASH key -> "TOKEN|META"),
    one for every shard of a single server, so a cap holds cluster-wide; on a Redis
    Cluster each shard keeps its own (``ShardKeys.fair(rule) + "run:"``)."""
    return f"{namespace}:{{{namespace}:fair}}:run:{rule}:"


def paused_rules(namespace: str) -> str:
    """The set of the rules an operator paused (query/controls.py), next to the node
    leases: one set for the namespace, whatever its shard layout, read by every worker
    node at start, on each reconnect and when ``paused_channel`` announces a change."""
    return f"{namespace}:{{{namespace}:nodes}}:paused"


def protocol_version(namespace: str) -> str:
    """The touch protocol's version the namespace's keys follow, "MAJOR.MINOR"
    (docs/protocol.md): written by the first writer or node when absent, read by every
    client, which refuses a major version it does not speak."""
    return f"{namespace}:{{{namespace}:nodes}}:protocol"


def paused_channel(namespace: str) -> str:
    """Where a pause or a resume is announced (the paused set's tag)."""
    return f"{namespace}:{{{namespace}:nodes}}:paused-changed"


def audit_log(namespace: str) -> str:
    """The namespace's audit log: a capped stream of the operator actions (who, what,
    when, how many), on a slot of its own (store/audit_stream.py)."""
    return f"{namespace}:{{{namespace}:audit}}:log"


def namespace_glob(name: str) -> str:
    """A SCAN pattern (not a key) matching every key of the namespace ``name``, its glob
    characters escaped: for cleaning up a namespace of its own, such as the demo's."""
    escaped = "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in name)
    return f"{escaped}:*"
