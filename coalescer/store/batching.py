"""Script calls of many shards, sent together: pipelines instead of one round trip each.

A node makes one call per shard at a time (claims, lease renewals, upserts), and
a deployment may have up to 16,384 shards. Sent one by one, each call costs a
round trip, a pooled connection and a few hundred microseconds of Python; at
thousands of shards that is more than a node has. Here every call joins the queue
of its destination (the one server, or in a Redis Cluster the master that owns the
call's slot: every key of a call carries its shard's hash tag, so a call has one
slot), and at most ``MAX_PIPELINES`` senders per destination each take up to
``MAX_BATCH`` queued calls and send them as one pipeline (non-transactional), the
masters of a cluster concurrently. Every call is still its own atomic script:
batching changes how calls travel, not what they do. A lone call goes out at once,
in a pipeline of one.

Each sender keeps one connection to its destination while it sends and writes its
pipelines there directly: taking a pooled connection and building a redis-py
pipeline cost more Python time than a claim of 16 keys in Redis (and redis-py
refuses scripts in a Redis Cluster pipeline). On a single server a connection
error disconnects it (the next use reconnects) and the pipeline is sent once more
on the fresh connection, as redis-py's own retry would.

In a cluster a call whose reply is a redirection (MOVED, ASK) or a cluster state error
(TRYAGAIN, CLUSTERDOWN), every call of a pipeline whose connection failed, and a call
whose slot has no known master go once more through redis-py's own cluster execution
(at most ``MAX_CLUSTER_CALLS`` at once), as docs/concepts.md ("Connections") says.

With ``durability: replicas: N`` (N > 0) a pipeline that holds a durable call ends
with ``WAIT N TIMEOUT`` on the same connection (docs/durability.md); when fewer
replicas did in time, each durable call of it fails with ``ReplicationError``. A
durable call that goes alone is sent with ``EVAL`` and ``WAIT`` on a held connection
on a single server; in a Redis Cluster it goes through redis-py's own path, so it
cannot be confirmed and fails with ``ReplicationError`` (0 acknowledged) after it ran.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.config.durability import NO_REPLICAS, Durability
from coalescer.errors import ReplicationError

log = logging.getLogger(__name__)

MAX_PIPELINES = 4  # pipelines in flight at once per destination: the connections calls use
MAX_BATCH = 256  # calls per pipeline: keeps each one short, so others are not held up
MAX_CLUSTER_CALLS = 8  # calls sent one by one at once on a Redis Cluster (below its pool bound)

# replies that say the slot map is stale or the cluster busy: redis-py's path handles them
_CLUSTER_RETRY = (AskError, TryAgainError, ClusterDownError)  # MovedError is an AskError
_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(slots=True)
class _Call:
    script: Any  # a registered redis-py Script
    keys: list[str]
    args: list[Any]
    future: asyncio.Future[Any]
    durable: bool = False  # confirmed by WAIT when the deployment asks for replicas


class _Links(Protocol):
    """Where a lane's connections come from, and go back to."""

    cluster: bool

    async def take(self) -> Any: ...

    def give_back(self, connection: Any) -> None: ...


class _ServerLinks:
    """Connections of a single server's pool, held by the senders while idle."""

    cluster = False

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._idle: list[Any] = []

    async def take(self) -> Any:
        if self._idle:
            return self._idle.pop()
        return await self._redis.connection_pool.get_connection()

    def give_back(self, connection: Any) -> None:
        self._idle.append(connection)


class _MasterLinks:
    """Connections of one cluster master (its redis-py ``ClusterNode``)."""

    cluster = True

    def __init__(self, node: Any) -> None:
        self.node = node  # replaced when the slot map names a new object for the master

    async def take(self) -> Any:
        return self.node.acquire_connection()  # MaxConnectionsError: a connection error

    def give_back(self, connection: Any) -> None:
        self.node.release(connection)


class _Lane:
    """The queued calls of one destination and the senders that send them."""

    def __init__(self, links: _Links, alone: Callable[[_Call], Awaitable[None]],
                 sent: Counter[str], name: str, durability: Durability = NO_REPLICAS) -> None:
        self.links = links
        self._durability = durability
        self._alone = alone  # one call through redis-py's own execution
        self._sent = sent  # round trips made, by destination
        self._name = name
        self._queue: list[_Call] = []
        self._senders: set[asyncio.Task[None]] = set()
        self._active = 0  # senders still taking from the queue

    def put(self, call: _Call) -> None:
        self._queue.append(call)
        if self._active < MAX_PIPELINES:
            self._active += 1
            sender = asyncio.ensure_future(self._drain())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                await self._send_or_fail(batch)
        finally:
            self._active -= 1  # no await since the queue was seen empty: nothing strands

    async def _send_or_fail(self, batch: list[_Call]) -> None:
        try:
            await self._send(batch)
        except asyncio.CancelledError as exc:
            _fail_all(batch, exc)
            raise
        except _CONNECTION_ERRORS as exc:
            await self._connection_failed(batch, exc)
        except Exception as exc:  # a call's arguments could not be sent (not encodable...)
            if len(batch) == 1:
                _fail_all(batch, exc)
            else:  # each call alone, so one call's bad arguments fail only that call
                await self._each_alone(batch)

    async def _connection_failed(self, batch: list[_Call], exc: BaseException) -> None:
        if not self.links.cluster:  # already sent twice: every caller hears
            _fail_all(batch, exc)
            return
        log.info("pipeline to %s failed (%r): its %d calls go one by one",
                 self._name, exc, len(batch))
        await self._each_alone(batch)  # redis-py's cluster path refreshes the slot map

    async def _each_alone(self, batch: list[_Call]) -> None:
        await asyncio.gather(*(self._go_alone(c) for c in batch if not c.future.done()))

    async def _send(self, batch: list[_Call]) -> None:
        commands = [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in batch]
        wait = self._wait(batch)
        replies = await self._exchange(commands + wait)
        short = self._shortfall(replies.pop()) if wait else None
        retry = []
        for call, reply in zip(batch, replies, strict=True):
            if self._again(reply):
                retry.append(call)
            else:
                _settle(call, reply, short)
        if retry:
            await asyncio.gather(*(self._go_alone(c) for c in retry))

    def _wait(self, batch: list[_Call]) -> list[tuple[Any, ...]]:
        """``[WAIT N TIMEOUT]`` when a call of ``batch`` is durable and replicas are asked for."""
        wanted = self._durability.replicas
        if not wanted or not any(c.durable for c in batch):
            return []
        return [("WAIT", wanted, self._durability.timeout_ms)]

    def _shortfall(self, acked: Any) -> ReplicationError | None:
        """None when WAIT's answer ``acked`` counts enough replicas, else the error
        (an error reply counts as none)."""
        count = acked if isinstance(acked, int) else 0
        if count >= self._durability.replicas:
            return None
        return ReplicationError(count, self._durability.replicas, self._durability.timeout)

    async def _go_alone(self, call: _Call) -> None:
        """A call redis-py's path must send; a durable one on a single server is sent
        with its source (the server may have lost the script) and WAIT, here."""
        if call.durable and self._durability.replicas and not self.links.cluster:
            await self._send_source(call)
        else:
            await self._alone(call)

    async def _send_source(self, call: _Call) -> None:
        wanted, timeout_ms = self._durability.replicas, self._durability.timeout_ms
        try:
            reply, acked = await self._exchange([
                ("EVAL", call.script.script, len(call.keys), *call.keys, *call.args),
                ("WAIT", wanted, timeout_ms)])
        except Exception as exc:
            _fail_all([call], exc)
            return
        _settle(call, reply, self._shortfall(acked))

    def _again(self, reply: Any) -> bool:
        """Whether the call goes once more alone: the server lost the script (redis-py
        loads it), or the cluster redirected the call or could not run it now."""
        return isinstance(reply, NoScriptError) or (
            self.links.cluster and isinstance(reply, _CLUSTER_RETRY))

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` as one pipeline on a held connection; their replies (an
        error reply as its exception). On a single server a connection error is tried
        once more."""
        connection = await self.links.take()
        try:
            packed = connection.pack_commands(commands)
            self._sent[self._name] += 1
            try:
                return await _round_trip(connection, packed, len(commands))
            except RedisConnectionError:
                await connection.disconnect()
                if self.links.cluster:
                    raise
                self._sent[self._name] += 1
                return await _round_trip(connection, packed, len(commands))
        except BaseException:
            await connection.disconnect()  # in an unknown state: the next use reconnects
            raise
        finally:
            self.links.give_back(connection)


async def _round_trip(connection: Any, packed: list[bytes], n: int) -> list[Any]:
    if not connection.is_connected:  # its own connect(): a Sentinel's asks for the master
        await connection.connect()
    await connection.send_packed_command(packed, check_health=False)
    replies: list[Any] = []
    for _ in range(n):
        try:
            replies.append(await connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def _settle(call: _Call, reply: Any, short: ReplicationError | None) -> None:
    """Answer ``call`` with ``reply``; a durable call's success with ``short`` when its
    WAIT fell short (carrying the reply)."""
    if call.future.done():
        return
    if isinstance(reply, Exception):
        call.future.set_exception(reply)
    elif call.durable and short is not None:
        call.future.set_exception(ReplicationError(short.acknowledged, short.wanted,
                                                   short.timeout, reply))
    else:
        call.future.set_result(reply)


def _fail_all(batch: list[_Call], exc: BaseException) -> None:
    for call in batch:
        if not call.future.done():
            call.future.set_exception(exc)


class ScriptBatcher:
    """Queues script calls and sends them in pipelines, per master in a Redis Cluster."""

    def __init__(self, redis: Any, durability: Durability = NO_REPLICAS) -> None:
        self._redis = redis
        self._durability = durability
        self.round_trips: Counter[str] = Counter()  # pipelines sent, by destination
        self._cluster = isinstance(redis, RedisCluster)
        self._alone_slots = asyncio.Semaphore(MAX_CLUSTER_CALLS) if self._cluster else None
        self._lanes: dict[str, _Lane] = {}
        self._masters: dict[str, _MasterLinks] = {}
        if not self._cluster:
            self._lanes[""] = _Lane(_ServerLinks(redis), self._call_alone,
                                    self.round_trips, "server", durability)

    async def call(self, script: Any, keys: list[str], args: list[Any], *,
                   durable: bool = False) -> Any:
        """Run ``script``; a ``durable`` call is confirmed by WAIT (see the module)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call = _Call(script, keys, args, future, durable)
        lane = self._lane(keys)
        if lane is None:
            await self._call_alone(call)
        else:
            lane.put(call)
        return await future

    def _lane(self, keys: list[str]) -> _Lane | None:
        if not self._cluster:
            return self._lanes[""]
        node = self._master(keys)
        if node is None:
            return None
        lane = self._lanes.get(node.name)
        if lane is None:
            self._masters[node.name] = links = _MasterLinks(node)
            lane = self._lanes[node.name] = _Lane(links, self._call_alone, self.round_trips,
                                                  node.name, self._durability)
        else:
            self._masters[node.name].node = node  # the master's object in the current map
        return lane

    def _master(self, keys: list[str]) -> Any:
        """The master of the call's slot in the client's slot map; None if it has no key
        or the map does not know the slot (redis-py's own path then finds out)."""
        if not keys:
            return None
        try:
            return self._redis.get_node_from_key(keys[0])
        except RedisClusterException:  # the slot is not covered (yet)
            return None

    async def _call_alone(self, call: _Call) -> None:
        if self._alone_slots is None:
            await _run_alone(call)
            return
        if call.durable and self._durability.replicas:
            await self._unconfirmed(call)
            return
        async with self._alone_slots:
            await _run_alone(call)

    async def _unconfirmed(self, call: _Call) -> None:
        """A durable call through redis-py's cluster path: no WAIT can follow it on the
        connection it used, so a success is answered as confirmed by no replica."""
        ran = _Call(call.script, call.keys, call.args,
                    asyncio.get_running_loop().create_future())
        async with self._alone_slots or asyncio.Semaphore():
            await _run_alone(ran)
        if ran.future.exception() is not None:
            _fail_all([call], ran.future.exception() or RuntimeError())
            return
        durability = self._durability
        _settle(call, ran.future.result(),
                ReplicationError(0, durability.replicas, durability.timeout))


async def _run_alone(call: _Call) -> None:
    try:
        result = await call.script(keys=call.keys, args=call.args)
    except Exception as exc:
        if not call.future.done():
            call.future.set_exception(exc)
    else:
        if not call.future.done():
            call.future.set_result(result)
