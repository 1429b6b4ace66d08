"""The namespace's shard layout, kept in Redis, and the steps of a live reshard.

Which shard holds a key, where the count a namespace uses lives and what a live reshard
does for an operator: docs/operations.md, "Changing shards with the fleet running". A
worker node whose rules file names another count begins a reshard
(``reshard_begin.lua``): a new generation maps every key with the new count, and the
old count stays in ``from`` while the old shards are drained.

While a reshard runs, a key lives in exactly one shard: its old shard until it is
moved, then its new one. Writers write a key whose two shards differ to its old
shard "held" (written only if the old shard still holds it, else asked back, see
upsert.lua) and the asked keys to the new shard; the leader of each old shard moves
its keys out (``worker/mover.py``: ``reshard_take.lua``, then ``reshard_put.lua`` in
the new shard). Every shard keeps a marker of the newest generation written to it:
a writer of an older one is refused and reads the layout again. The node that begins
a reshard raises the old shards' markers at once (and each old shard's mover does so
again with its first call, before it scans the shard), so no key is written by the old
mapping once the reshard began, nor behind a mover's scan. A key taken out of its old
shard but not yet put into its new one (its mover died, or is slow) is put there by the
first writer or cancel that meets it (``carry``).
When every old shard is drained (``reshard_drained.lua``), a last generation ends the
reshard.

Both steps announce the change on the layout's channel, which worker nodes listen on
(so an idle node pays nothing to follow the layout); a node also reads it once a
minute, and writers learn of it from a refused write, or read it again every
``RECHECK`` seconds while they believe a reshard runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coalescer.store import keys as key_names
from coalescer.store.fair_settings import copy_overrides
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.paused_copies import copy_paused
from coalescer.store.script_calls import KEY_SEPARATOR
from coalescer.store.scripts import Scripts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutInfo:
    """A layout as read from Redis (``gen`` 0: not read yet, the rules file's count)."""

    gen: int
    shards: int
    source: int = 0  # the old count while a reshard runs, else 0
    began_ms: int = 0
    ended_ms: int = 0
    moved: int = 0  # keys the movers of the last reshard moved (as they reported)
    by: str = ""  # the node that began the last reshard
    drained: frozenset[int] = frozenset()  # old shards emptied by the running reshard
    was: int = 0  # the count the last reshard that ended came from

    @property
    def resharding(self) -> bool:
        return self.source > 0

    def keyspace(self, namespace: str) -> KeySpace:
        return KeySpace(namespace, self.shards, self.source, self.gen)


def parse_layout(reply: Sequence[Any]) -> LayoutInfo:
    """A layout.lua reply."""
    gen, shards, source, began, ended, moved, by, drained, was = reply
    return LayoutInfo(gen=int(gen), shards=int(shards), source=int(source),
                      began_ms=int(began), ended_ms=int(ended), moved=int(moved), by=str(by),
                      drained=frozenset(int(n) for n in drained), was=int(was))


@dataclass(frozen=True, slots=True)
class Taken:
    """What reshard_take.lua took out of a shard: its fencing tokens so far, the
    bundles (key -> JSON) and the keys it left because they run now."""

    seq: int
    bundles: dict[str, str] = field(default_factory=dict)
    running: tuple[str, ...] = ()


def bundle_shard(bundle: str) -> int:
    """The new shard a bundle of reshard_take.lua goes to."""
    return int(json.loads(bundle)["d"])


async def put_bundles(scripts: Scripts, shard: ShardKeys, source_seq: int,
                      bundles: Sequence[str], *, durable: bool = False) -> int:
    """Put bundles taken from an old shard (``source_seq``: its fencing tokens so far)
    into their new shard ``shard``; one put already is skipped. How many were put.
    ``durable``: counted only once the replicas hold it (a mover's put, see Layouts)."""
    keys = [shard.meta, shard.seq, shard.next_wake, shard.rule_names, shard.arrived]
    args = [shard.wake_channel, shard.prefix, source_seq, *bundles]
    return int(await scripts.call("reshard_put", keys, args, durable=durable))


async def carry(scripts: Scripts, keyspace: KeySpace, source_seq: int,
                bundles: Sequence[str], *, durable: bool = False) -> None:
    """Put bundles still in transit (their mover has not put them yet: it died, or is
    slow) into their new shards of ``keyspace``, one call per shard: a writer or a
    cancel that met them in their old shard does so before acting in the new one."""
    by_shard: dict[int, list[str]] = defaultdict(list)
    for bundle in bundles:
        by_shard[bundle_shard(bundle)].append(bundle)
    await asyncio.gather(*(put_bundles(scripts, keyspace.shard(n), source_seq, part,
                                       durable=durable)
                           for n, part in by_shard.items()))


RECHECK = 5.0  # seconds between two reads of the layout by a writer while a reshard runs


class Layouts:
    """The layout this process follows, shared by its writer and its node; read again
    on demand (a refused write, a node lease call that saw a new generation)."""

    def __init__(self, scripts: Scripts, namespace: str, configured: int) -> None:
        self._scripts = scripts
        self.namespace = namespace
        self.configured = configured
        self.info = LayoutInfo(gen=0, shards=configured)
        self.keyspace = self.info.keyspace(namespace)
        self._listeners: list[Callable[[LayoutInfo], None]] = []
        self._lock = asyncio.Lock()
        self._rechecked = time.monotonic()

    @property
    def channel(self) -> str:
        """Where layout changes are announced (worker nodes listen)."""
        return key_names.layout_channel(self.namespace)

    def on_change(self, listener: Callable[[LayoutInfo], None]) -> None:
        self._listeners.append(listener)

    def _keys(self) -> list[str]:
        return [key_names.layout(self.namespace), key_names.drained(self.namespace)]

    async def refresh(self, *, newer_than: int = -1) -> LayoutInfo:
        """Read the layout (creating it with the configured count if there is none).
        ``newer_than``: skip the read if a concurrent one already got past it."""
        async with self._lock:
            if self.info.gen > newer_than >= 0:
                return self.info
            reply = await self._scripts.call("layout", self._keys(), [self.configured])
            self._set(parse_layout(reply))
            return self.info

    async def recheck(self) -> None:
        """While a reshard runs, read the layout again once RECHECK seconds passed since
        the last look: a writer then learns that the reshard ended even if no shard
        refuses its writes (the node that ended it died before raising the shards'
        markers), instead of routing through the old shards for as long as it runs.
        Errors are raised (the caller goes on with the layout it has)."""
        now = time.monotonic()
        if self.info.resharding and now - self._rechecked >= RECHECK:
            self._rechecked = now
            await self.refresh()

    def _set(self, info: LayoutInfo) -> None:
        changed = (info.gen, info.drained) != (self.info.gen, self.info.drained)
        self.info, self.keyspace = info, info.keyspace(self.namespace)
        if changed:
            for listener in self._listeners:
                listener(info)

    async def begin(self, shards: int, node_id: str) -> bool:
        """Begin a reshard to ``shards`` from the generation last read; True if this
        call began it (False: another node did, or a reshard runs). Reads again."""
        began = await self._scripts.call("reshard_begin", self._keys(),
                                         [self.info.gen, shards, node_id, self.channel])
        await self.refresh()
        if int(began) == 1:  # the new shards' copies of the paused rules
            keyspace = self.info.keyspace(self.namespace)
            await copy_paused(self._scripts.client, self.namespace, keyspace.all_shards())
            await copy_overrides(self._scripts.client, self.namespace, keyspace.all_shards())
        return int(began) == 1

    async def raise_markers(self) -> None:
        """Raise every old shard's marker to the running reshard's generation, as each
        old shard's mover does with its first call: from then on no writer that has not
        read the new layout writes to an old shard by the old mapping (it is sent to read
        it), so a key never gets a burst in both of its shards. One call per old shard."""
        info = self.info
        if not info.resharding:
            return
        keyspace = info.keyspace(self.namespace)
        await asyncio.gather(*(self.take(keyspace.shard(n), info.gen, [], [], [])
                               for n in range(info.source)))

    async def drained(self, gen: int, shard: int, moved: int) -> bool:
        """Old shard ``shard`` is empty; True if that ended the reshard."""
        ended = await self._scripts.call("reshard_drained", self._keys(),
                                         [gen, shard, moved, self.channel])
        return int(ended) == 1

    async def take(self, shard: ShardKeys, gen: int, keys: Sequence[str],  # noqa: PLR0913
                   dests: Sequence[int], rules: Sequence[str], *,
                   durable: bool = False) -> Taken | None:
        """Take ``keys`` out of ``shard`` for their new shards ``dests`` (see
        reshard_take.lua); None if the shard follows a newer generation than ``gen``.
        ``durable``: the mover's takes, puts and carries count only once the replicas
        hold them (``durability: replicas``; else ReplicationError): a shard is
        reported drained only on moves a failover keeps."""
        reply = await self._scripts.call(
            "reshard_take", [shard.meta, shard.moving, shard.seq, shard.layout,
                             shard.rule_names],
            [gen, shard.prefix, len(keys), KEY_SEPARATOR.join(keys),
             KEY_SEPARATOR.join(map(str, dests)), KEY_SEPARATOR.join(rules)],
            durable=durable)
        if int(reply[0]) == 0:
            return None
        flat = reply[2]
        return Taken(int(reply[1]), {str(flat[i]): str(flat[i + 1])
                                     for i in range(0, len(flat), 2)},
                     tuple(str(k) for k in reply[3]))

    async def put(self, shard: ShardKeys, source_seq: int, bundles: Sequence[str], *,
                  durable: bool = False) -> int:
        """Put bundles taken from an old shard into their new shard ``shard`` (one put
        already is skipped); returns how many were put. ``durable``: see ``take``."""
        return await put_bundles(self._scripts, shard, source_seq, bundles, durable=durable)

    async def carry(self, keyspace: KeySpace, source_seq: int, bundles: Sequence[str], *,
                    durable: bool = False) -> None:
        """Put ``bundles`` into their new shards of ``keyspace`` (see ``carry``);
        ``durable``: see ``take``."""
        await carry(self._scripts, keyspace, source_seq, bundles, durable=durable)

    async def scan(self, shard: ShardKeys, cursor: int, count: int) -> tuple[int, list[str]]:
        """One HSCAN step over ``shard``'s keys: the next cursor (0: done) and keys."""
        cursor, fields = await self._scripts.client.hscan(shard.meta, cursor, count=count)
        return int(cursor), [str(k) for k in fields]

    async def moving(self, shard: ShardKeys) -> dict[str, str]:
        """The bundles a mover took out of ``shard`` and did not delete (it died)."""
        found = await self._scripts.client.hgetall(shard.moving)
        return {str(k): str(v) for k, v in found.items()}

    async def forget_moved(self, shard: ShardKeys, keys: Sequence[str]) -> None:
        """Delete bundles that are in their new shard now."""
        if keys:
            await self._scripts.client.hdel(shard.moving, *keys)

    async def mark_all(self, keyspace: KeySpace) -> None:
        """Raise every shard's marker to ``keyspace.gen`` (a reshard ended: writers of
        the generation before it are sent to read the layout, and write straight to
        each key's shard from then on), and drop what the shards kept of the bundles
        put. Plain commands in one pipeline."""
        pipe = self._scripts.client.pipeline(transaction=False)
        for shard in keyspace.all_shards():
            pipe.set(shard.layout, keyspace.gen)
            pipe.delete(shard.arrived)
        await pipe.execute()
