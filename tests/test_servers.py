"""The test-suite's own server helpers work against real processes."""

from __future__ import annotations

from redis.asyncio.cluster import RedisCluster

from tests.helpers.servers import Cluster, ValkeyProcess


async def test_cluster_has_three_masters_serving_all_slots(cluster: Cluster) -> None:
    assert len(cluster.urls) == 3
    client = RedisCluster.from_url(cluster.urls[1], decode_responses=True)
    try:
        await client.initialize()
        keys = [f"{{t{i}}}:k" for i in range(30)]
        slots = {client.keyslot(key) for key in keys}
        owners = {getattr(client.get_node_from_key(key), "port", None) for key in keys}
        assert len(slots) == len(keys) and owners == set(cluster.ports)
        for key in keys:
            await client.set(key, key.upper())
        assert [await client.get(key) for key in keys] == [key.upper() for key in keys]
        masters = [n for n in client.get_nodes() if n.server_type == "primary"]
        assert len(masters) == 3
    finally:
        await client.aclose()


def test_own_server_restart_and_kill(own_server: ValkeyProcess) -> None:
    client = own_server.client()
    client.set("k", "v")
    own_server.kill()
    assert not own_server.running
    own_server.restart()
    assert client.ping()
    client.close()
