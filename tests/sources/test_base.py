"""The registry of source types, and status of a source whose type it lacks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

import pytest_asyncio
import redis.asyncio

from coalescer.config.rules import Config
from coalescer.config.sources import SourceConfig
from coalescer.query.source_status import add_sources, format_sources
from coalescer.sources.base import SOURCE_TYPES, Source
from coalescer.sources.streams import Sources, open_streams, stream_status


def test_the_registry_holds_the_stream_type() -> None:
    stream = SOURCE_TYPES["stream"]
    assert (stream.name, stream.open, stream.status) == ("stream", open_streams,
                                                           stream_status)
    assert issubclass(Sources, Source)


@dataclass(frozen=True, kw_only=True, slots=True)
class ElsewhereSource(SourceConfig):
    """A source of a type no module under sources/ registers."""

    type: ClassVar[str] = "elsewhere"


@pytest_asyncio.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    found = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    yield found
    await found.aclose()


async def test_status_shows_the_type_of_a_source_of_an_unregistered_type(
        client: redis.asyncio.Redis, namespace: str) -> None:
    base = Config.from_string(f"namespace: {namespace}\nrules:\n"
                              "  - {name: a, match: 'a:{id}', handler: builtins:repr}\n")
    config = Config(namespace=base.namespace, shards=1, leader_lease=3.0, claim_lease=5.0,
                    rules=base.rules, source="<test>",
                    sources=(ElsewhereSource(name="far", line=9),))
    status: dict[str, object] = {}
    await add_sources(client, config, status)
    assert status["sources"] == {"far": {"type": "elsewhere", "rejected": 0}}
    assert format_sources(status)[-1].split() == ["far", "?", "?", "0", "(elsewhere)"]
