"""Listens on the shards' wake channels and routes each message to its shard.

A dropped subscription must never strand work: an idle poller makes no call
until it is woken, so a message published while the connection was down would be
lost for good. Every subscription the server confirms (the first, and each one
redis-py makes again after it reconnects on its own) is passed on to its shard as
``SUBSCRIBED``, which wakes the poller (or the standby) to look at once: what was
published before the confirmation is read then, what comes after it arrives. After an
error the listener backs off, subscribes again and pokes every shard as well.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio import Redis

from coalescer.common.metrics import Metrics
from coalescer.common.retrying import keep_running

log = logging.getLogger(__name__)

SUBSCRIBED = "subscribed"  # passed to a route when its channel's subscription is confirmed


class WakeListener:
    """One pub/sub connection per node for all its shards."""

    def __init__(self, redis: Redis, routes: Mapping[str, Callable[[Any], None]],
                 on_reconnect: Callable[[], None], metrics: Metrics) -> None:
        self._redis = redis
        self._routes = dict(routes)
        self._pubsub: Any = None  # while subscribed
        self._on_reconnect = on_reconnect
        self._metrics = metrics
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        await keep_running("wake channel subscription", self._listen, logger=log,
                           on_error=self._lost)

    def _lost(self, exc: Exception) -> None:
        self.subscribed.clear()
        self._metrics.redis_errors.labels("wakeups").inc()

    async def _listen(self) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
        try:
            await pubsub.subscribe(*self._routes)
            self._pubsub = pubsub
            self.subscribed.set()
            self._on_reconnect()
            while True:
                message = await pubsub.get_message(timeout=5.0)
                if message is not None:
                    self._dispatch(message)
        finally:
            self._pubsub = None
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    def add_route(self, channel: str, route: Callable[[Any], None]) -> None:
        """Route ``channel`` too (a shard added by a reshard), subscribing at once when
        connected; its confirmation reaches the route as ``SUBSCRIBED``."""
        self._routes[channel] = route
        if self._pubsub is not None:
            task = asyncio.ensure_future(self._pubsub.subscribe(channel))
            task.add_done_callback(_logged)

    def _dispatch(self, message: dict[str, Any]) -> None:
        route = self._routes.get(message["channel"])
        if route is None:
            return
        kind = message["type"]
        if kind == "message":
            route(message["data"])
        elif kind == "subscribe":
            route(SUBSCRIBED)


def _logged(task: asyncio.Future[Any]) -> None:
    """A late subscription failed: the connection is going; subscribing again after the
    reconnect covers the channel."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("subscribing to a new shard's wake channel failed: %r", task.exception())
