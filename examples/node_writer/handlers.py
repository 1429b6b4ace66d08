"""The handlers of the Node writer demo: each records its claim and the time, so the
demo can report what the Python node ran for the Node writer's touches.

A real handler recomputes an aggregate (a SQL GROUP BY, a search document, a cached
report) from the source of truth.
"""

from __future__ import annotations

import time

from coalescer.claim import Claim

REFRESHED: list[tuple[Claim, float]] = []


async def refresh_user(claim: Claim) -> None:
    """Pretend to recompute one user's statistics."""
    REFRESHED.append((claim, time.time()))


async def refresh_order(claim: Claim) -> None:
    """Pretend to rebuild one order's summary from the rows touched (``claim.items``)."""
    REFRESHED.append((claim, time.time()))
