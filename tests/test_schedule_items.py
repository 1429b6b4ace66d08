"""A schedule replaces a key's burst, its items too: a re-created scheduled task's
refresh gets only the items touched with it or after it, unless ``keep_items=True``;
through the Python API on a real server (store/lua/upsert.lua)."""

from __future__ import annotations

from coalescer import Coalescer
from tests.test_schedule import setup, writer

__all__ = ["setup", "writer"]  # the fixture, used by name


async def _items(c: Coalescer, *keys: str) -> dict[str, tuple[str, ...]]:
    """The items each key's next refresh gets, as ``coalescer explain`` shows them."""
    return {key: tuple((await c.query.explain(key))["items"]["pending_items"]) for key in keys}


async def test_a_new_schedule_drops_the_items_of_the_burst_it_replaces(
        writer: Coalescer) -> None:
    writer.touch_items([("bag:1", "old-1"), ("bag:1", "old-2"), ("bag:2", "old"),
                        ("bag:3", "old")], delay="1h")
    writer.touch("bag:4", "old")  # a plain burst: a schedule replaces it too
    await writer.flush()
    writer.touch("bag:1", "new", delay="3h")  # the task re-created
    writer.touch("bag:2", delay="2h")  # re-created with no item of its own
    writer.touch("bag:3", "new", delay="2h", keep_items=True)  # asked to keep them
    writer.touch("bag:4", "new", delay="1h")
    await writer.flush()
    writer.touch("bag:1", "after")  # a plain touch after the schedule keeps its items
    await writer.flush()
    assert await _items(writer, "bag:1", "bag:2", "bag:3", "bag:4") == {
        "bag:1": ("after", "new"), "bag:2": (), "bag:3": ("new", "old"), "bag:4": ("new",)}
