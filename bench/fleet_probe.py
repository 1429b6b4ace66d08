"""The refresh handler of the fleet bench's node processes (``bench.fleet``).

``record`` appends one "START DUE_MS KEY" line per refresh start (start: epoch seconds
of this host; due: the claim's due time, server ms: one machine, one clock) to the file
named by $BENCH_REFRESH_LOG, in batches: when 500 lines wait, a quarter of a second
after the first of a batch, and at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
from typing import Any

BATCH = 500  # lines written at once
FLUSH_S = 0.25  # seconds a line waits at most (while the node's loop runs)

_LINES: list[str] = []


async def record(claim: Any) -> None:
    """Record the refresh start and its due time; do nothing else."""
    if not _LINES:
        asyncio.get_running_loop().call_later(FLUSH_S, _write)
        atexit.register(_write)
    _LINES.append(f"{time.time():.6f} {claim.due_ms} {claim.key}\n")
    if len(_LINES) >= BATCH:
        _write()


def _write() -> None:
    atexit.unregister(_write)
    if _LINES:
        with open(os.environ["BENCH_REFRESH_LOG"], "a") as f:
            f.write("".join(_LINES))
        _LINES.clear()


def read_records(path: os.PathLike[str] | str) -> list[tuple[float, int, str]]:
    """The (start s, due ms, key) lines of a ``record`` file; a torn last line is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and line.endswith("\n"):
                    out.append((float(parts[0]), int(parts[1]), parts[2]))
    except FileNotFoundError:
        pass
    return out
