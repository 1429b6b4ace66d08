"""An HttpApi serving a stub node (no Redis), run as a process of its own:

    python -m tests.helpers.http_node PORT '{"max_connections": 1000}'

Logs to stderr as `coalescer run` does (time, level, logger, message) and serves until
SIGTERM. For the tests that need a process with a file limit of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from types import SimpleNamespace
from typing import Any

from coalescer.common.metrics import Metrics
from coalescer.web.api import HttpApi


class StubReads:
    async def status(self) -> dict[str, Any]:
        return {"rules": {}}

    async def explain(self, key: str) -> dict[str, Any]:
        return {"key": key}


class StubNode:
    """Every touch accepted and forgotten; Redis always reachable."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.query = StubReads()
        self.config = SimpleNamespace(rules=[])
        self.touched: list[str] = []

    def touch_many(self, keys: list[str]) -> None:
        self.touched.extend(keys)

    def unwritten_age(self) -> float | None:
        return None

    def dropped_keys(self) -> list[dict[str, Any]]:
        return []

    def health_problems(self) -> list[str]:
        return []

    def sync_metrics(self) -> None:
        pass

    def unknown_keys(self, keys: list[str]) -> list[str]:
        return []

    async def ping(self) -> bool:
        return True


async def serve(port: int, options: dict[str, Any]) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with HttpApi(StubNode(), port=port, **options):  # type: ignore[arg-type]
        await stop.wait()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(int(sys.argv[1]), json.loads(sys.argv[2])))


if __name__ == "__main__":
    main()
