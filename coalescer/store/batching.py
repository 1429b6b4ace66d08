"""Script calls of many shards, sent together: pipelines instead of one round trip each.

A node makes one call per shard at a time (claims, lease renewals, upserts), and
a deployment may have up to 16,384 shards. Sent one by one, each call costs a
round trip, a pooled connection and a few hundred microseconds of Python; at
thousands of shards that is more than a node has. Here every call joins a queue,
and at most ``MAX_PIPELINES`` senders each take up to ``MAX_BATCH`` queued calls
and send them as one pipeline (non-transactional; in a Redis Cluster, redis-py
sends each node the calls of its own slots). Every call is still its own atomic
script: batching changes how calls travel, not what they do. A lone call goes
out at once, in a pipeline of one. redis-py refuses scripts in a Redis Cluster
pipeline, so there calls go one by one, at most ``MAX_CLUSTER_CALLS`` at once.

On a single server each sender keeps one connection of the pool for itself and
writes its pipelines there directly: taking a pooled connection and building a
redis-py pipeline cost more Python time than a claim of 16 keys in Redis. A
connection error disconnects it (the next use reconnects) and the pipeline is
sent once more on the fresh connection, as redis-py's own retry would.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

MAX_PIPELINES = 4  # pipelines in flight at once: the connections script calls use
MAX_BATCH = 256  # calls per pipeline: keeps each one short, so others are not held up
MAX_CLUSTER_CALLS = 8  # calls in flight at once on a Redis Cluster (below its pool bound)


@dataclass(slots=True)
class _Call:
    script: Any  # a registered redis-py Script
    keys: list[str]
    args: list[Any]
    future: asyncio.Future[Any]


class ScriptBatcher:
    """Queues script calls and sends them in pipelines."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._queue: list[_Call] = []
        self._senders: set[asyncio.Task[None]] = set()
        self._active = 0  # senders still taking from the queue
        self._connections: list[Any] = []  # held for the senders (single server), idle now
        self._cluster_slots = (asyncio.Semaphore(MAX_CLUSTER_CALLS)
                               if isinstance(redis, RedisCluster) else None)

    async def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        if self._cluster_slots is not None:
            async with self._cluster_slots:
                return await script(keys=keys, args=args)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call(script, keys, args, future))
        if self._active < MAX_PIPELINES:
            self._active += 1
            sender = asyncio.ensure_future(self._drain())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

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
        except (RedisConnectionError, RedisTimeoutError, OSError,
                asyncio.CancelledError) as exc:  # the connection failed: every caller hears
            self._fail_all(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        except Exception as exc:  # a call's arguments could not be sent (not encodable...)
            if len(batch) == 1:
                self._fail_all(batch, exc)
            else:  # each call alone, so one call's bad arguments fail only that call
                await asyncio.gather(*(self._call_alone(c) for c in batch
                                       if not c.future.done()))

    @staticmethod
    def _fail_all(batch: list[_Call], exc: BaseException) -> None:
        for call in batch:
            if not call.future.done():
                call.future.set_exception(exc)

    async def _send(self, batch: list[_Call]) -> None:
        commands = [("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args) for c in batch]
        replies = await self._exchange(commands)
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError):  # the server lost it: load it, run it again
                await self._call_alone(call)
            elif call.future.done():
                continue
            elif isinstance(reply, Exception):
                call.future.set_exception(reply)
            else:
                call.future.set_result(reply)

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` as one pipeline on a held connection; their replies (an
        error reply as its exception). A connection error is tried once more."""
        connection = await self._held_connection()
        try:
            packed = connection.pack_commands(commands)
            try:
                return await self._round_trip(connection, packed, len(commands))
            except RedisConnectionError:
                await connection.disconnect()
                return await self._round_trip(connection, packed, len(commands))
        except BaseException:
            await connection.disconnect()  # in an unknown state: the next use reconnects
            raise
        finally:
            self._connections.append(connection)

    @staticmethod
    async def _round_trip(connection: Any, packed: list[bytes], n: int) -> list[Any]:
        await connection.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies

    async def _held_connection(self) -> Any:
        if self._connections:
            return self._connections.pop()
        return await self._redis.connection_pool.get_connection()

    @staticmethod
    async def _call_alone(call: _Call) -> None:
        try:
            result = await call.script(keys=call.keys, args=call.args)
        except Exception as exc:
            if not call.future.done():
                call.future.set_exception(exc)
        else:
            if not call.future.done():
                call.future.set_result(result)
