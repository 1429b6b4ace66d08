"""Every Redis key is built in coalescer.store.keys and carries its shard's hash tag."""

from __future__ import annotations

import zlib
from collections import Counter

from coalescer.store.keys import KeySpace


def _all_keys(space: KeySpace, shard: int) -> list[str]:
    sk = space.shard(shard)
    return [sk.leader, sk.epoch, sk.seq, sk.next_wake, sk.nodes, sk.meta, sk.wake_channel,
            sk.due("r"), sk.inflight("r"), sk.dead("r")]


def test_every_key_of_a_shard_starts_with_the_namespace_and_carries_its_hash_tag() -> None:
    space = KeySpace("app", 4)
    for shard in range(4):
        keys = _all_keys(space, shard)
        assert len(set(keys)) == len(keys)
        for key in keys:
            assert key.startswith("app:")
            # the first {...} is what Redis Cluster hashes: one slot per shard
            assert key[key.index("{") + 1 : key.index("}")] == f"app:{shard}"


def test_namespaces_never_share_keys() -> None:
    assert not set(_all_keys(KeySpace("a", 1), 0)) & set(_all_keys(KeySpace("b", 1), 0))


def test_shard_of_is_stable_and_spreads_keys() -> None:
    space = KeySpace("app", 8)
    keys = [f"stats:user:{n}" for n in range(8000)]
    assert all(space.shard_of(k) == zlib.crc32(k.encode()) % 8 for k in keys)
    counts = Counter(space.shard_of(k) for k in keys)
    assert set(counts) == set(range(8))
    assert min(counts.values()) > 800  # roughly even: 1000 each
    assert KeySpace("app", 1).shard_of("anything") == 0
