"""Replicated Redis: a real primary and replica (``--replicaof``), and ``durability:
replicas`` making every write wait for the replica (WAIT).

A replica that lags is made real with SIGSTOP: it stops reading what the primary sends
and acknowledging it, as a replica on a saturated link or a stalled host does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coalescer import Coalescer
from coalescer.errors import ReplicationError, UnwrittenTouchesError
from coalescer.store.keys import KeySpace
from tests.conftest import Start
from tests.helpers.e2e import Recorder, recorder_rules
from tests.helpers.servers import (
    Cluster,
    ValkeyProcess,
    freeze,
    replica_of,
    thaw,
    wait_until,
)

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 1s
{durability}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 5s
rules:
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


def rules(tmp_path: Path, namespace: str, durability: str = "",
          claim_lease: str = "1s") -> tuple[Path, Recorder]:
    text = RULES.format(ns=namespace, durability=durability).replace(
        "claim_lease: 1s", f"claim_lease: {claim_lease}")
    return recorder_rules(tmp_path, f"rec_{namespace}", text)


def rules_without_replicas(path: Path) -> Path:
    """The rules of ``path`` with no ``durability:`` (for a primary left with no replica)."""
    alone = path.with_name("alone.yaml")
    alone.write_text("\n".join(line for line in path.read_text().splitlines()
                               if not line.startswith("durability:")))
    return alone


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ValkeyProcess, ValkeyProcess]]:
    """A primary and its replica, in sync."""
    primary = ValkeyProcess(dir=tmp_path / "primary")
    try:
        replica = replica_of(primary, tmp_path / "replica")
    except BaseException:
        primary.stop()
        raise
    try:
        yield primary, replica
    finally:
        thaw(replica)
        replica.stop()
        primary.stop()


def blocked_in_wait(server: ValkeyProcess) -> bool:
    """Whether a client of ``server`` waits in WAIT for its replicas now."""
    client = server.client()
    try:
        return any(c.get("cmd") == "wait" and "b" in c.get("flags", "")
                   for c in client.client_list())
    finally:
        client.close()


def promote(replica: ValkeyProcess) -> None:
    client = replica.client()
    try:
        client.execute_command("REPLICAOF", "NO", "ONE")
    finally:
        client.close()


def pending_on(server: ValkeyProcess, namespace: str, keys: list[str]) -> list[str]:
    """The ``keys`` that ``server`` holds a pending refresh (or a run) of."""
    client = server.client()
    try:
        meta = KeySpace(namespace, 1).shard(0).meta
        found = client.hmget(meta, keys)
    finally:
        client.close()
    return [key for key, state in zip(keys, found, strict=True) if state is not None]


async def test_a_flush_returns_only_once_the_replica_holds_the_touches_and_they_survive_a_failover(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start) -> None:
    primary, replica = pair
    # a writer's long wait (a claim's wait is at most a quarter of its lease)
    path, rec = rules(tmp_path, namespace, "durability: {replicas: 1, timeout: 5s}",
                      claim_lease="20s")
    writer = Coalescer.from_yaml(path, redis_url=primary.url, worker=False)
    await writer.start()
    keys = [f"item:{i}" for i in range(200)]
    freeze(replica)  # lagging: it holds none of what follows
    for key in keys:
        writer.touch(key)
    flushing = asyncio.ensure_future(writer.flush())
    await wait_until(lambda: blocked_in_wait(primary), message="the flush waiting for a replica")
    assert not flushing.done()
    thaw(replica)
    await flushing
    primary.kill()  # at once: whatever the replica does not hold by now is lost
    await writer.close()
    promote(replica)

    assert pending_on(replica, namespace, keys) == keys
    await start(rules_without_replicas(path), redis_url=replica.url, node_id="after-failover")
    await wait_until(lambda: set(keys) <= {c.key for c in rec.calls}, timeout=15.0,
                     message="every acknowledged key refreshed on the promoted replica")


async def test_a_flush_the_replica_does_not_acknowledge_in_time_raises_and_keeps_the_touches(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start) -> None:
    primary, replica = pair
    path, _ = rules(tmp_path, namespace, "durability: {replicas: 1, timeout: 100ms}")
    writer = await start(path, redis_url=primary.url, worker=False)
    keys = [f"item:{i}" for i in range(20)]
    freeze(replica)
    for key in keys:
        writer.touch(key)
    with pytest.raises(ReplicationError) as failed:
        await writer.flush()
    assert (failed.value.acknowledged, failed.value.wanted) == (0, 1)
    assert "only 0 of 1 Redis replicas acknowledged" in str(failed.value)

    thaw(replica)
    # the touches were kept, and are written and replicated once the replica catches up
    await wait_until(lambda: flushed(writer), message="a flush confirmed by the replica")
    assert pending_on(replica, namespace, keys) == keys


async def flushed(c: Coalescer) -> bool:
    try:
        await c.flush()
    except ReplicationError:
        return False
    return True


async def test_a_node_does_not_run_a_claim_the_replica_did_not_confirm_and_gives_it_back(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start, caplog: pytest.LogCaptureFixture) -> None:
    primary, replica = pair
    path, rec = rules(tmp_path, namespace, "durability: {replicas: 1, timeout: 100ms}")
    caplog.set_level(logging.DEBUG, logger="coalescer.worker.poller")
    freeze(replica)
    node = await start(path, redis_url=primary.url, node_id="n1")
    node.touch("item:1")
    with pytest.raises(ReplicationError):
        await node.flush()  # on the primary, not confirmed: kept (and written again)
    await wait_until(lambda: "claim not confirmed by the replicas" in caplog.text,
                     message="a claim refused for its WAIT")
    assert rec.calls == []  # the claim was made on the primary, and not run
    assert in_flight(primary, namespace) == 0  # given back, not left to its lease

    thaw(replica)
    await wait_until(lambda: rec.calls, message="the refresh once the replica is back")
    assert rec.calls[0].attempt == 1  # the claims given back used up no attempt


async def test_an_ack_the_replica_does_not_confirm_is_recorded_once_and_said_once(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start, caplog: pytest.LogCaptureFixture) -> None:
    primary, replica = pair
    path, rec = rules(tmp_path, namespace, "durability: {replicas: 1, timeout: 100ms}")
    gate = asyncio.Event()

    async def hold(claim: Any) -> None:
        await gate.wait()

    rec.hook = hold
    node = await start(path, redis_url=primary.url, node_id="n1")
    node.touch("item:1")
    await node.flush()
    await wait_until(lambda: rec.calls, message="the refresh running")
    freeze(replica)  # the run's result cannot reach the replica now
    gate.set()
    await wait_until(lambda: "refresh results recorded on the primary, but only 0 of 1" in
                     caplog.text, message="the unconfirmed ack said")
    assert pending_on(primary, namespace, ["item:1"]) == []  # finished on the primary
    assert "taken over" not in caplog.text  # not sent again (it would find itself stale)
    assert caplog.text.count("refresh results recorded on the primary") == 1
    thaw(replica)


def in_flight(server: ValkeyProcess, namespace: str) -> int:
    client = server.client()
    try:
        return int(client.zcard(KeySpace(namespace, 1).shard(0).inflight("item")))
    finally:
        client.close()


async def test_on_a_cluster_each_master_is_asked_for_its_replicas(
        tmp_path: Path, namespace: str, cluster: Cluster) -> None:
    """The session's cluster has masters only: a write that asks for a replica is
    written on each master, and confirmed by none."""
    text = RULES.format(ns=namespace, durability="durability: {replicas: 1, timeout: 50ms}")
    path = tmp_path / "rules.yaml"
    path.write_text(text.replace("namespace:", "shards: 6\nnamespace:")
                    .replace("{mod}:refresh", "json:dumps"))
    c = Coalescer.from_yaml(path, redis_url=cluster.url, worker=False)
    await c.start()
    for i in range(60):
        c.touch(f"item:{i}")
    try:
        with pytest.raises(ReplicationError) as failed:
            await c.flush()
        assert (failed.value.acknowledged, failed.value.wanted) == (0, 1)
    finally:
        with pytest.raises(UnwrittenTouchesError) as unwritten:  # not confirmed: not written
            await c.close(flush_timeout=0.2)
    assert unwritten.value.count == 60


@pytest.mark.parametrize("case", [
    ("", 50, 50),  # the primary alone acknowledges: all of it is lost with it
    ("durability: {replicas: 1, timeout: 50ms}", 0, 0),  # nothing acknowledged, nothing lost
])
async def test_touches_acknowledged_while_the_replica_was_cut_off_are_lost_unless_replicas(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        case: tuple[str, int, int]) -> None:
    durability, acknowledged, lost = case
    primary, replica = pair
    path, _ = rules(tmp_path, namespace, durability)
    writer = Coalescer.from_yaml(path, redis_url=primary.url, worker=False)
    await writer.start()
    promote(replica)  # cut off (a partition): it holds nothing written from now on
    keys = [f"item:{i}" for i in range(50)]
    for key in keys:
        writer.touch(key)
    done: list[str] = []
    with contextlib.suppress(ReplicationError):
        await writer.flush()
        done = keys
    primary.kill()  # and the cut-off replica is the one left to promote
    with contextlib.suppress(UnwrittenTouchesError):
        await writer.close(flush_timeout=0.2)
    assert len(done) == acknowledged
    assert len(set(done) - set(pending_on(replica, namespace, keys))) == lost


async def test_without_replicas_a_flush_does_not_wait_for_a_stalled_replica(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start) -> None:
    primary, replica = pair
    path, _ = rules(tmp_path, namespace)
    writer = await start(path, redis_url=primary.url, worker=False)
    freeze(replica)
    writer.touch("item:1")
    await writer.flush()  # no WAIT: acknowledged by the primary alone
    assert not blocked_in_wait(primary)
    thaw(replica)


async def test_fencing_tokens_grow_across_the_promotion_of_a_replica_that_missed_claims(
        tmp_path: Path, namespace: str, pair: tuple[ValkeyProcess, ValkeyProcess],
        start: Start) -> None:
    primary, replica = pair
    path, rec = rules(tmp_path, namespace)
    node = await start(path, redis_url=primary.url, node_id="before")
    await refresh_once(node, rec, "item:1")
    await wait_until(lambda: not pending_on(primary, namespace, ["item:1"]),
                     message="the first refresh acknowledged")
    await wait_until(lambda: replica_caught_up(primary), message="the replica in sync")
    promote(replica)  # cut off: from here on it misses every claim of the primary
    for _ in range(3):
        await refresh_once(node, rec, "item:1")
    before = [c.token for c in rec.of("item:1")]
    await node.close()
    primary.kill()

    after = await start(path, redis_url=replica.url, node_id="after")
    await refresh_once(after, rec, "item:1")
    tokens = [c.token for c in rec.of("item:1")]
    assert tokens[-1] > max(before), tokens
    assert tokens == sorted(set(tokens)), tokens
    assert all(0 < t < 2**53 for t in tokens), tokens


async def refresh_once(c: Coalescer, rec: Recorder, key: str) -> None:
    seen = len(rec.of(key))
    c.touch(key)
    await c.flush()
    await wait_until(lambda: len(rec.of(key)) > seen, message=f"a refresh of {key}")


def replica_caught_up(primary: ValkeyProcess) -> bool:
    client = primary.client()
    try:
        info: dict[str, Any] = client.info("replication")
    finally:
        client.close()
    offset = int(info["master_repl_offset"])
    replica = info.get("slave0") or {}
    return isinstance(replica, dict) and int(replica.get("offset", -1)) == offset
