"""The refresh handlers of the demo's rules: each records its claim and the time, so the
demo can report what ran.

A real handler recomputes an aggregate (a SQL GROUP BY, a search document, a cached
report) from the source of truth.
"""

from __future__ import annotations

import asyncio
import time

from coalescer.claim import Claim

REFRESHED: list[tuple[Claim, float]] = []


async def refresh_user(claim: Claim) -> None:
    """Pretend to recompute one user's statistics."""
    REFRESHED.append((claim, time.time()))
    await asyncio.sleep(0.02)


def refresh_org(claim: Claim) -> None:
    """A plain (sync) handler: on threads of the node (``isolation: thread``), as it
    records in the node's memory; by default it would run in a child process."""
    REFRESHED.append((claim, time.time()))
    time.sleep(0.02)
