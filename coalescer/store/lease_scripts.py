"""The leases' script wrappers: a shard's leadership and its live nodes, each node's
own lease, benching a node, forgetting a lapsed one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coalescer.store.keys import ShardKeys
from coalescer.store.script_calls import ScriptCalls
from coalescer.store.script_types import Benched, LeaseState, NodeLeases, Peer


class LeaseScripts(ScriptCalls):
    """Shard leadership and node leases."""

    async def acquire(self, shard: ShardKeys, *, node_id: str, lease_ms: int,
                      mine: str, rules: str = "", take_from: str = "") -> LeaseState:
        """Take or keep the shard's leadership; register ``rules`` (registry.encode).
        ``take_from`` is a holder value whose node's lease the caller saw lapse: the
        shard is taken over if it still holds that value."""
        keys = [shard.leader, shard.epoch, shard.nodes, shard.rules, shard.rule_names]
        epoch, holder, ttl, live, adopt = await self._run(
            "acquire", keys, [node_id, lease_ms, mine, rules, take_from, shard.wake_channel])
        return LeaseState(int(epoch), str(holder), int(ttl), int(live),
                          tuple(str(n) for n in adopt))

    async def release(self, shard: ShardKeys, *, value: str, node_id: str, leave: bool) -> bool:
        """Give up the shard's lease if still held; ``leave`` also leaves the node set."""
        keys = [shard.leader, shard.nodes]
        args = [value, shard.wake_channel, node_id, "1" if leave else "0"]
        return int(await self._run("release", keys, args)) == 1

    async def peers(self, shard: ShardKeys, live_ms: int) -> tuple[int, list[Peer]]:
        """Server time and the shard's live worker nodes with their registered rules."""
        result = await self._run("peers", [shard.nodes, shard.rules], [live_ms])
        rest = result[1:]
        return int(result[0]), [Peer(str(rest[i]), int(float(rest[i + 1])), str(rest[i + 2]))
                                for i in range(0, len(rest), 3)]

    async def node_lease(self, leases: str, *, node_id: str, lease_ms: int,
                         period_ms: int = 0,
                         forgotten: Sequence[tuple[str, int]] = ()) -> NodeLeases:
        """Renew this node's lease (``lease_ms`` 0: drop it; ``period_ms``: to end on a
        multiple of it plus the lease) and read every node's; ``forgotten`` are nodes
        judged lapsed, with the lease end read, whose shard entries this node removed."""
        args: list[Any] = [node_id, lease_ms, period_ms]
        for node, ends in forgotten:
            args += [node, ends]
        return self._node_leases(await self._run_now("node_lease", [leases], args))

    async def lease_ends(self, leases: str) -> dict[str, int]:
        """Every node's lease end (server ms): one plain ZRANGE, no script, no clock (a look
        between renewals, see node_lease.py)."""
        every = await self._redis.zrange(leases, 0, -1, withscores=True)
        return {str(node): int(float(ends)) for node, ends in every}

    async def lease_look(self, leases: str) -> NodeLeases:
        """Every node's lease end with the server's time, renewing nothing: one script
        call, one read inside (a look between renewals, see node_lease.py)."""
        return self._node_leases(await self._run_now("node_lease", [leases], ["", -1, 0]))

    async def bench(self, benched: str, leases: str, *, node_id: str, cool_off_ms: int,
                    others: Sequence[str]) -> Benched:
        """Bench this node for ``cool_off_ms`` if one of ``others`` (the other nodes it
        counts live) has a lease and is not benched; ``cool_off_ms`` -1 only reads who is
        benched now."""
        now, done, every = await self._run_now("bench", [benched, leases],
                                               [node_id, cool_off_ms, *others])
        ends = {str(every[i]): int(float(every[i + 1])) for i in range(0, len(every), 2)}
        return Benched(int(now), bool(int(done)), ends)

    @staticmethod
    def _node_leases(result: Any) -> NodeLeases:
        now, lapsed, every = result
        ends = {str(every[i]): int(float(every[i + 1])) for i in range(0, len(every), 2)}
        return NodeLeases(int(now), bool(int(lapsed)), ends)

    async def forget(self, shards: Sequence[ShardKeys], node: str) -> None:
        """Drop a node whose lease lapsed from every shard's node set and rules registry:
        plain commands in one pipeline (on a Redis Cluster, one per master)."""
        pipe = self._redis.pipeline(transaction=False)
        for shard in shards:
            pipe.zrem(shard.nodes, node)
            pipe.hdel(shard.rules, node)
        await pipe.execute()
