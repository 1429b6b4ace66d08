"""What ``coalescer status`` shows of a Kafka source: what its live nodes last reported
in Redis (``sources_kafka``: each partition's offsets and lag, each node's error)."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from coalescer.config.kafka_source import KafkaSource
from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig
from coalescer.store.keys import sources_kafka

REPORT_IDLE = 30.0  # seconds between two reports of an unchanged source (kafka.py's)
REPORT_STALE = 3 * REPORT_IDLE  # a report older than this is a gone node's


async def kafka_status(redis: Any, source: SourceConfig, config: Config) -> dict[str, Any]:
    """What the live nodes last saw of ``source``: each partition's committed offset,
    end offset and lag (and the node reading it), their total lag, and every node's
    error while failing."""
    assert isinstance(source, KafkaSource)
    found = await redis.hgetall(sources_kafka(config.namespace))
    now_ms = time.time() * 1000
    partitions: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    prefix = f"{source.name}|"
    for name, raw in found.items():
        if not name.startswith(prefix):
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            entry = json.loads(raw)
            if now_ms - entry["at_ms"] > REPORT_STALE * 1000:
                continue
            kind, _, rest = name[len(prefix):].partition("|")
            if kind == "node":
                if entry["error"]:
                    errors[rest] = entry["error"]
            else:
                partitions[f"{kind}/{rest}"] = {k: entry[k] for k in
                                                ("node", "committed", "end", "lag")}
    lags = [p["lag"] for p in partitions.values()]
    return {"type": "kafka", "topics": list(source.topics), "group": source.group,
            "lag": None if not lags or None in lags else sum(lags),
            "partitions": dict(sorted(partitions.items())), "errors": errors}
