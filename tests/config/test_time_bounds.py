"""A touch's ``at`` or ``delay`` text is read in time bounded by a length checked first:
a longer one is refused (naming the value, cut short) before any parser reads it."""

from __future__ import annotations

import pytest

from coalescer.config.durations import MAX_TEXT
from coalescer.config.schedule import schedule_spec
from coalescer.errors import InvalidScheduleError


class Watched(str):
    """A text that counts the calls that would read it whole (strip, replace, split)."""

    reads = 0

    def strip(self, chars: str | None = None) -> str:
        Watched.reads += 1
        return str.strip(self, chars)

    def replace(self, old: str, new: str, count: int = -1) -> str:  # type: ignore[override]
        Watched.reads += 1
        return str.replace(self, old, new, count)


@pytest.fixture(autouse=True)
def _count_from_zero() -> None:
    Watched.reads = 0


@pytest.mark.parametrize("field", ["at", "delay"])
@pytest.mark.parametrize("size", [1 << 10, 1 << 20])
def test_a_long_time_is_refused_by_its_length_unread(field: str, size: int) -> None:
    hostile = Watched("2030-01-01T00:00:00+00:00" + " " * size + "x")
    with pytest.raises(InvalidScheduleError) as info:
        schedule_spec("k", **{field: hostile})
    assert f"longer than {MAX_TEXT} characters" in info.value.reason
    message = str(info.value)
    assert f"({len(hostile)} characters)" in message and len(message) < 400
    assert Watched.reads == 0


@pytest.mark.parametrize(("field", "text"), [
    ("at", "2030-01-01T00:00:00+00:00"), ("at", "1900000000"), ("delay", "1d"),
    ("delay", " 30m ")])
def test_a_time_within_the_bound_is_read(field: str, text: str) -> None:
    padded = Watched(text + " " * (MAX_TEXT - len(text)))
    spec = schedule_spec("k", **{field: padded})
    assert spec is not None and spec[0] == field[0]
    assert Watched.reads >= 1


def test_a_day_is_a_delay_unit() -> None:
    assert schedule_spec("k", delay="2d") == f"d{2 * 86_400_000}"
