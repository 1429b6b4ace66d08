"""`SyncCoalescer` (SPEC §4): touch and flush from plain threads, as Django or Flask do."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from e2e import line_rules

from coalescer import ClosedError, SyncCoalescer, UnknownKeyError
from coalescer.keys import KeySpace

RULES = """\
namespace: {ns}
defaults:
  window: 30s
  max_wait: 60s
  absorb: 10ms
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""

THREADS = 8
KEYS_PER_THREAD = 50


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    return line_rules(tmp_path, f"sync_{namespace}", RULES.format(ns=namespace))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_threads_touch_and_flush_blocks_until_redis_holds_them(
        rules: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    due = KeySpace(namespace, 1).shard(0).due("item")
    missing: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        def write_path(n: int) -> None:
            try:
                keys = [f"item:{n}-{i}" for i in range(KEYS_PER_THREAD)]
                for key in keys:
                    sc.touch(key)
                    sc.touch("item:hot")
                sc.flush()
                # flush returned: Redis holds every key this thread touched
                missing[n] = [k for k in [*keys, "item:hot"] if r.zscore(due, k) is None]
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=write_path, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with pytest.raises(UnknownKeyError):
            sc.touch("nope:1")
    assert errors == []
    assert missing == {n: [] for n in range(THREADS)}
    assert r.zcard(due) == THREADS * KEYS_PER_THREAD + 1


def test_context_manager_and_idempotent_close(
        rules: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    due = KeySpace(namespace, 1).shard(0).due("item")
    with SyncCoalescer.from_yaml(rules, redis_url=redis_url) as sc:
        assert sc.coalescer.worker is False  # a write path by default
        sc.touch("item:1")
    # a clean shutdown flushes first
    assert r.zscore(due, "item:1") is not None
    with pytest.raises(ClosedError):
        sc.touch("item:2")
    sc.close()
    sc.close()

    sc = SyncCoalescer.from_yaml(rules, redis_url=redis_url)
    sc.start()
    sc.touch("item:3")
    sc.flush()
    assert r.zscore(due, "item:3") is not None
    sc.close()
    sc.close()
    with pytest.raises(ClosedError):
        sc.touch("item:4")
    assert r.zcard(due) == 2
