"""Example refresh handlers used by rules.yaml (and `coalescer demo --rules rules.yaml`).

A real handler recomputes an aggregate (a SQL GROUP BY, a search document, a
cached report) from the source of truth. These record each call so the demo
can show what happened.
"""

from __future__ import annotations

import asyncio
import time

from coalescer import Claim

REFRESHED: list[tuple[Claim, float]] = []


async def refresh_user(claim: Claim) -> None:
    """Pretend to recompute one user's statistics."""
    REFRESHED.append((claim, time.time()))
    await asyncio.sleep(0.02)


def refresh_org(claim: Claim) -> None:
    """A plain (sync) handler: runs in coalescer's thread pool."""
    REFRESHED.append((claim, time.time()))
    time.sleep(0.02)
