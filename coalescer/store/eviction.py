"""Redis's ``maxmemory-policy``: one that may evict coalescer's keys (``allkeys-*``) is
refused at start (EvictionPolicyError) and watched while running. Why, which keys have a
TTL (so ``volatile-*`` is fine) and how the policy is read: docs/operations.md, "Redis
memory". A running node reads it again every ``CHECK_EVERY`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from coalescer.common.metrics import Metrics
from coalescer.common.retrying import keep_running
from coalescer.errors import EvictionPolicyError

log = logging.getLogger(__name__)

CHECK_EVERY = 30.0  # seconds between two reads of the policy by a running coalescer
FIX = "CONFIG SET maxmemory-policy noeviction"

Policies = dict[str, str | None]  # server address -> its policy (None: unreadable)


def evicts(policy: str | None) -> bool:
    """True for a policy that may evict keys without a TTL (coalescer's)."""
    return policy is not None and policy.startswith("allkeys-")


async def _policy_of(client: Any, **target: Any) -> str | None:
    """One server's policy: CONFIG GET, else INFO memory, else None."""
    try:
        reply = await client.execute_command("CONFIG", "GET", "maxmemory-policy", **target)
        found = _from_config(reply)
        if found is not None:
            return found
    except (RedisError, OSError) as exc:
        log.debug("CONFIG GET maxmemory-policy refused: %r; reading INFO memory", exc)
    try:
        info = await client.execute_command("INFO", "memory", **target)
    except (RedisError, OSError) as exc:
        log.debug("INFO memory refused too: %r", exc)
        return None
    value = info.get("maxmemory_policy") if isinstance(info, dict) else None
    return str(value) if value else None


def _from_config(reply: Any) -> str | None:
    if isinstance(reply, dict):
        value = reply.get("maxmemory-policy")
        return str(value) if value else None
    if isinstance(reply, list) and len(reply) >= 2:
        return str(reply[1])
    return None


async def read_policies(client: Any) -> Policies:
    """The policy of the server, or of every master of a Redis Cluster."""
    if isinstance(client, RedisCluster):
        masters = client.get_primaries()
        found = await asyncio.gather(*(_policy_of(client, target_nodes=node)
                                       for node in masters))
        return {node.name: policy for node, policy in zip(masters, found, strict=True)}
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return {where: await _policy_of(client)}


def problem(policies: Policies) -> str | None:
    """What is wrong with the policies, naming the setting and the fix; None if nothing."""
    bad = {where: p for where, p in policies.items() if evicts(p)}
    if not bad:
        return None
    servers = ", ".join(f"{p} on {where}" for where, p in sorted(bad.items()))
    return (f"Redis maxmemory-policy is {servers}: at maxmemory Redis may evict "
            "coalescer's keys (pending touches, claims, leases) and lose them without a "
            f"trace; run '{FIX}' (and set it in redis.conf), or use a volatile-* policy")


async def check_at_start(client: Any, *, refuse: bool = True) -> Policies:
    """Raise EvictionPolicyError on an evicting policy (only log it at ERROR when not
    ``refuse``: a tool that reads, such as ``coalescer status``); warn (and go on) when
    the policy cannot be read. Returns what was read."""
    policies = await read_policies(client)
    wrong = problem(policies)
    if wrong is not None and refuse:
        raise EvictionPolicyError(wrong)
    if wrong is not None:
        log.error("%s", wrong)
    unread = sorted(where for where, p in policies.items() if p is None)
    if unread:
        log.warning("could not read maxmemory-policy on %s (CONFIG GET and INFO memory "
                    "refused): make sure it is noeviction or volatile-*, never allkeys-*",
                    ", ".join(unread))
    return policies


class PolicyWatch:
    """Reads the policy every ``CHECK_EVERY`` seconds; ``reason`` says what is wrong."""

    def __init__(self, client: Any, metrics: Metrics, policies: Policies,
                 every: float | None = None) -> None:
        self._client = client
        self._metrics = metrics
        self._every = every if every is not None else CHECK_EVERY
        self._policies = policies
        self.reason: str | None = problem(policies)
        metrics.evicting.set(1 if self.reason else 0)

    async def run(self) -> None:
        """Read the policy every ``CHECK_EVERY`` seconds (it was read at start)."""
        await self._rest()
        await keep_running("maxmemory-policy check", self.check, logger=log, rest=self._rest)

    async def _rest(self) -> None:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Python 3.11's wait_for (redis-py connects with it) can swallow a cancel
            # that comes as its inner call ends: stop anyway
            raise asyncio.CancelledError
        await asyncio.sleep(self._every)

    async def check(self) -> None:
        """Read the policies once; report a change."""
        read = await read_policies(self._client)
        # a server that could not be read this time keeps what it had
        policies = {where: p if p is not None else self._policies.get(where)
                    for where, p in read.items()}
        if policies == self._policies:
            return
        self._policies = policies
        reason = problem(policies)
        if reason is not None and reason != self.reason:
            log.error("%s", reason)
        elif reason is None and self.reason is not None:
            log.warning("Redis maxmemory-policy no longer evicts coalescer's keys: %s",
                        ", ".join(f"{p} on {w}" for w, p in sorted(policies.items())))
        self.reason = reason
        self._metrics.evicting.set(1 if reason else 0)


async def policy_status(client: Any) -> dict[str, Any]:
    """The ``memory`` entry of ``coalescer status --json``: each server's policy (None:
    unreadable), whether one may evict coalescer's keys, and what to do about it."""
    policies = await read_policies(client)
    reason = problem(policies)
    return {"maxmemory_policy": policies, "evicting": reason is not None, "problem": reason}


def policy_lines(status: dict[str, Any]) -> list[str]:
    """The warning ``coalescer status`` prints for an evicting policy (else nothing)."""
    memory = status.get("memory") or {}
    reason = memory.get("problem")
    return ["", f"WARNING: {reason}"] if reason else []
