"""The seed's in-process delay queue, for bench/kafka.py: a consumer that parks every
message in a heap in memory until its time (``delayTime`` minutes ahead), committing as
it reads. Prints ``{"parked": N, "peak_rss_mb": ...}`` once N messages are parked.

    python -m bench.kafka_queue BOOTSTRAP TOPIC N
"""

from __future__ import annotations

import asyncio
import heapq
import json
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def park(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer  # type: ignore[import-untyped]

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id="seed-queue",
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    queue: list[tuple[float, int, dict[str, object]]] = []  # (due, offset, message)
    try:
        while len(queue) < n:
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            now = time.time()
            for messages in batch.values():
                for m in messages:
                    value = json.loads(m.value)
                    heapq.heappush(queue, (now + 60 * value["delayTime"], m.offset, value))
            await consumer.commit()
    finally:
        await consumer.stop()
    return {"parked": len(queue), "peak_rss_mb": peak_rss_mb()}


if __name__ == "__main__":
    bootstrap, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(asyncio.run(park(bootstrap, topic, count))))
