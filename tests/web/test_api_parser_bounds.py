"""POST /touch with a hostile ``at``/``delay`` or a deeply nested body: a 400 naming
the problem, read in time bounded by a length (or a depth) checked first; nothing applied."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from tests.web.test_api import NodeFactory, make_node

__all__ = ["make_node"]  # the fixture, used by name

SOON = (datetime.now(UTC).replace(microsecond=0) + timedelta(days=7)).isoformat()


@pytest.mark.parametrize(("field", "value"), [
    ("delay", "1" + " " * 120_000 + "x"),
    ("delay", " " * 120_000 + "1s"),
    ("at", SOON + " " * 120_000),
])
async def test_a_long_time_is_400_naming_its_field(make_node: NodeFactory, field: str,
                                                   value: str) -> None:
    node = await make_node(worker=False)
    status, body = await node.touch({"keys": ["stats:user:1"], field: value})
    assert status == 400
    assert body["field"] == field
    assert "longer than 64 characters" in body["error"]
    assert f"({len(value)} characters)" in body["error"]  # shown cut short, with its length
    assert len(body["error"]) < 500
    assert await node.pending() == 0
    assert await node.touch({"keys": ["stats:user:2"], field: "1d" if field == "delay"
                             else SOON}) == (202, {"accepted": 1})  # a short one is read


@pytest.mark.parametrize("levels", [33, 200, 100_000])
async def test_a_deeply_nested_body_is_400_naming_the_depth(make_node: NodeFactory,
                                                          levels: int) -> None:
    node = await make_node(worker=False)
    raw = ('{"keys": ["stats:user:1"], "items": ' + "[" * levels + "]" * levels
           + "}").encode()
    status, body = await node.touch(raw)
    assert status == 400
    assert body["error"].startswith("malformed JSON: nested too deeply, more than 32 levels "
                                    "deep (at offset ")
    assert await node.pending() == 0


async def test_a_body_within_the_depth_is_read(make_node: NodeFactory) -> None:
    node = await make_node(worker=False)
    raw = json.dumps({"keys": ["stats:user:1"], "delay": "1d"}).encode()
    assert await node.touch(raw) == (202, {"accepted": 1})
