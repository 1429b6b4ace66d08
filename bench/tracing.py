"""touch() with tracing on beside tracing off, in one writer process.

Run: ``python -m bench.tracing`` (needs the ``otel`` extra). Starts a valkey-server of its
own, then times ``touch()`` calls of 1,000 keys over and over, each inside an active span
of the caller's (what a traced request does), first with no tracer provider set (tracing
off), then with the real SDK's provider set before the coalescer starts (tracing on:
each touch records its span context). The spans themselves are started outside the timed
calls: what is compared is the cost tracing adds to ``touch()``. Prints ns per touch for
both and the median of their ratios (the runs interleave off and on, so that a busy
moment of the machine hits both alike), and whether it is within 1.5x.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from bench.valkey import Server
from coalescer import Coalescer
from coalescer.config.rules import Config

KEYS = [f"stats:{i}" for i in range(1000)]
ROUNDS = 50  # rounds of the 1,000 keys per timed run
RUNS = 7
TARGET = 1.5

RULES = """\
namespace: bench-tracing
rules:
  - name: stats
    match: "stats:{id}"
    window: 1h
    max_wait: 2h
    handler: handlers:refresh
"""


def _timed(c: Coalescer) -> float:
    """ns per touch() of ROUNDS rounds of the keys, inside one active span."""
    with trace.get_tracer("bench").start_as_current_span("request"):
        touch = c.touch
        start = time.perf_counter_ns()
        for _ in range(ROUNDS):
            for key in KEYS:
                touch(key)
        took = time.perf_counter_ns() - start
    return took / (ROUNDS * len(KEYS))


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "rules.yaml").write_text(RULES)
        (root / "handlers.py").write_text("async def refresh(claim):\n    pass\n")
        config = Config.from_yaml(root / "rules.yaml")
        with Server(root) as server:
            async with Coalescer(config, redis_url=server.url, worker=False) as off:
                # set once the first coalescer started: it traces nothing, the second does
                trace.set_tracer_provider(TracerProvider())  # no exporter: spans dropped
                async with Coalescer(config, redis_url=server.url, worker=False) as on:
                    ratios, offs, ons = [], [], []
                    for _ in range(RUNS):  # interleaved: a busy moment hits both alike
                        offs.append(_timed(off))
                        ons.append(_timed(on))
                        ratios.append(ons[-1] / offs[-1])
                        await asyncio.gather(off.flush(), on.flush())
    ratio = statistics.median(ratios)
    print(f"touch() tracing off: {statistics.median(offs):.0f} ns, on: "
          f"{statistics.median(ons):.0f} ns, ratio {ratio:.2f}x (median of {RUNS} "
          f"interleaved runs; {'within' if ratio <= TARGET else 'OVER'} {TARGET}x)")


if __name__ == "__main__":
    asyncio.run(main())
