"""The baseline design (a hand-rolled ZSET poller), built faithfully, to measure coalescer against.

What many teams write first:

* ``touch(key)``: a local dedup cache (cachetools ``TTLCache``, 120 ms, 500
  entries) drops a touch of a key that is in the cache; any other touch is sent
  at once as ``ZADD due now+delay key``, ``now`` being the *client's* clock.
* a worker polls every 200 ms (a fixed interval): ``SET lock NX PX 1000``; if it
  got the lock, ``ZRANGEBYSCORE due -inf now LIMIT 0 20``, then per entry
  ``ZSCORE`` + ``ZREM``, and the handler runs for each entry this worker removed;
  then the lock is released (GET, and DEL if still its own).

Choices the design leaves open, made in the baseline's favour: the handlers of
one polled batch run concurrently (``asyncio.gather``), and the write path keeps
a pool of up to 64 connections so concurrent writers are not serialised.

``sliding=True`` is the variant whose cache entry is renewed by every touch, the
dropped ones too (``cache[key] = ...`` before the check): a key touched more
often than every 120 ms then stays cached for the whole burst.

Run a worker node as a process: ``python -m bench.baseline worker --redis URL
--log FILE`` (each refresh start appended to FILE as "TIME KEY").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import RedisError


@dataclass(frozen=True, slots=True)
class BaselineClaim:
    """What the baseline hands its handler: the key and its due time (client clock, ms)."""

    key: str
    due_ms: float


Handler = Callable[[BaselineClaim], Awaitable[None]]


async def _no_op(claim: BaselineClaim) -> None:
    return None


class Baseline:
    """One process of the baseline design: the write path, and optionally a worker."""

    def __init__(self, redis_url: str, handler: Handler = _no_op, *, delay: float = 2.0,
                 zset: str = "baseline:due", lock_key: str = "baseline:lock",
                 dedup_ttl: float = 0.120, dedup_size: int = 500, poll_interval: float = 0.2,
                 batch: int = 20, lock_ms: int = 1000, sliding: bool = False,
                 max_connections: int = 64) -> None:
        self.pool = BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=30, decode_responses=True,
            socket_timeout=30, socket_connect_timeout=5)
        self.redis = Redis(connection_pool=self.pool)
        self.handler = handler
        self.delay = delay
        self.zset = zset
        self.lock_key = lock_key
        self.poll_interval = poll_interval
        self.batch = batch
        self.lock_ms = lock_ms
        self.sliding = sliding
        self._cache: TTLCache[str, bool] = TTLCache(maxsize=dedup_size, ttl=dedup_ttl)
        self.node = uuid.uuid4().hex
        self.dropped = 0
        self.sent = 0
        self.refreshed = 0
        self.running = 0
        self._worker: asyncio.Task[None] | None = None
        self._closing = False

    # -- write path ------------------------------------------------------------------

    async def touch(self, key: str) -> None:
        """Dedup locally, else ``ZADD due now+delay key`` (client clock)."""
        if self.sliding:
            seen = key in self._cache
            self._cache[key] = True
            if seen:
                self.dropped += 1
                return
        else:
            if key in self._cache:
                self.dropped += 1
                return
            self._cache[key] = True
        await self.redis.zadd(self.zset, {key: time.time() + self.delay})
        self.sent += 1

    async def flush(self) -> None:
        """Nothing to do: every touch that was not dropped is in Redis when touch returns."""

    # -- worker ----------------------------------------------------------------------

    def start_worker(self) -> None:
        self._worker = asyncio.create_task(self._poll_loop(), name="baseline poller")

    async def _poll_loop(self) -> None:
        while not self._closing:
            try:
                await self.poll_once()
            except (OSError, RedisError) as exc:  # keep polling, as a real worker would
                if self._closing:  # a cancellation that surfaced as a timeout error
                    return
                print(f"baseline poll failed: {exc!r}")
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self) -> int:
        """One poll under the lock; returns how many handlers ran."""
        r = self.redis
        token = f"{self.node}:{uuid.uuid4().hex}"
        if not await r.set(self.lock_key, token, nx=True, px=self.lock_ms):
            return 0
        try:
            entries = await r.zrangebyscore(self.zset, "-inf", time.time(), start=0,
                                            num=self.batch)
            claims = []
            for key in map(str, entries):
                score = await r.zscore(self.zset, key)
                if await r.zrem(self.zset, key) and score is not None:
                    claims.append(BaselineClaim(key, float(score) * 1000.0))
            if claims:
                await asyncio.gather(*(self._run(c) for c in claims))
            return len(claims)
        finally:
            if await r.get(self.lock_key) == token:
                await r.delete(self.lock_key)

    async def _run(self, claim: BaselineClaim) -> None:
        self.running += 1
        try:
            await self.handler(claim)
        except Exception as exc:  # the baseline has no retries: a failure is dropped
            print(f"baseline handler failed for {claim.key}: {exc!r}")
        finally:
            self.running -= 1
            self.refreshed += 1

    async def close(self) -> None:
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.wait([self._worker], timeout=10)
        await self.redis.aclose()
        await self.pool.disconnect()

    async def __aenter__(self) -> Baseline:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# -- a worker process ------------------------------------------------------------------


async def _worker_main(args: argparse.Namespace) -> int:
    log = open(args.log, "a", buffering=1)  # noqa: SIM115

    async def handler(claim: BaselineClaim) -> None:
        log.write(f"{time.time():.6f} {claim.key}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    b = Baseline(args.redis, handler, delay=args.delay)
    b.start_worker()
    print(f"baseline worker {os.getpid()} polling {args.redis}", flush=True)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), args.max_seconds)
    await b.close()
    log.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.baseline")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run a baseline worker node")
    w.add_argument("--redis", required=True)
    w.add_argument("--log", required=True, help="append 'TIME KEY' per refresh start")
    w.add_argument("--delay", type=float, default=2.0)
    w.add_argument("--max-seconds", type=float, default=300.0, help="exit after this long")
    args = p.parse_args()
    return asyncio.run(_worker_main(args))


if __name__ == "__main__":
    raise SystemExit(main())
