"""Counting what an idle node costs: the server's command counts, and its lease renewals
as the unit of a window (never a duration)."""

from __future__ import annotations

from typing import Any

from coalescer.store.keys import node_leases
from tests.helpers.servers import wait_until

PROBE = "zmscore"  # the test's own reads: a command no node sends


def calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def renewals(redis_client: Any, namespace: str, node: str, count: int) -> None:
    """Wait until ``node`` renewed its lease ``count`` times (its lease end moved)."""
    key, seen = node_leases(namespace), []

    async def renewed() -> bool:
        (ends,) = await redis_client.zmscore(key, [node])
        if ends is not None and (not seen or ends != seen[-1]):
            seen.append(ends)
        return len(seen) > count
    await wait_until(renewed, timeout=30, interval=0.02,
                     message=f"{count} lease renewals of {node}")
