"""parse_duration and format_duration (durations in rules files)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from coalescer.config import durations
from coalescer.config.durations import MAX_TEXT, format_duration, parse_duration


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (2, 2.0),
        (0.25, 0.25),
        ("0.25", 0.25),
        ("3", 3.0),
        ("50ms", 0.05),
        ("2s", 2.0),
        ("1.5s", 1.5),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("0ms", 0.0),
        (".5s", 0.5),
        (" 2s ", 2.0),
        ("1d", 86400.0),
        ("1.5d", 129600.0),
        ("2 d", 172800.0),
    ],
)
def test_parse_accepts(value: object, seconds: float) -> None:
    assert math.isclose(parse_duration(value), seconds)


def test_parse_returns_float() -> None:
    assert isinstance(parse_duration(2), float)


@pytest.mark.parametrize(
    "value",
    [True, False, -1, -0.5, "-1s", "2 days", "5x", "", "s", "ms", "1e3", "1,5s", "2S",
     None, [], {}, float("inf"), float("nan"), "inf"],
)
def test_parse_refuses(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    message = str(info.value)
    assert repr(value) in message
    assert '"50ms"' in message and "seconds" in message


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.05, "50ms"),
        (0.0005, "0.5ms"),
        (1, "1s"),
        (2.0, "2s"),
        (1.5, "1.5s"),
        (90, "90s"),
        (120, "2m"),
        (300, "5m"),
        (3600, "1h"),
        (7200, "2h"),
        (5400, "90m"),
        (86400, "1d"),
        (172800, "2d"),
        (90000, "25h"),
        (129600, "36h"),
    ],
)
def test_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.05, 0.001, 0.25, 1.5, 2, 59, 61, 120, 3600, 86400])
def test_format_round_trips(seconds: float) -> None:
    assert math.isclose(parse_duration(format_duration(seconds)), seconds)


class CountingPattern:
    """The duration pattern, counting the characters it is given to read."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.read = 0

    def fullmatch(self, text: str) -> Any:
        self.read += len(text)
        return self.pattern.fullmatch(text)


@pytest.mark.parametrize("size", [1 << 10, 1 << 20])
def test_a_long_duration_is_refused_by_its_length_unread(
        monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    counting = CountingPattern(durations._DURATION_RE)
    monkeypatch.setattr(durations, "_DURATION_RE", counting)
    hostile = "1" + " " * size + "x"
    with pytest.raises(ValueError) as info:
        parse_duration(hostile)
    message = str(info.value)
    assert f"longer than {MAX_TEXT} characters" in message
    assert f"({size + 2} characters)" in message and "'1    " in message
    assert len(message) < 300  # the value is cut short, not repeated
    assert counting.read == 0


def test_the_pattern_reads_each_duration_once_whatever_its_spaces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingPattern(durations._DURATION_RE)
    monkeypatch.setattr(durations, "_DURATION_RE", counting)
    assert parse_duration("1" + " " * (MAX_TEXT - 3) + "d") == 86400.0
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration("1" + " " * (MAX_TEXT - 2) + "x")
    assert counting.read <= 2 * MAX_TEXT  # one reading of each, its spaces stripped


def test_the_pattern_has_no_repeats_that_could_share_characters() -> None:
    # Backtracking grows with the length of the spaces only where two adjacent repeats
    # can both match them: the stripped text leaves the pattern one run of spaces.
    assert durations._DURATION_RE.pattern.count("\\s*") == 2  # after '-', before the unit
    assert "\\s*(?P<unit>" in durations._DURATION_RE.pattern
    assert not durations._DURATION_RE.pattern.endswith("\\s*")
