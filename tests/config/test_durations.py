"""parse_duration and format_duration (durations in rules files)."""

from __future__ import annotations

import math

import pytest

from coalescer.config.durations import format_duration, parse_duration


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
    ],
)
def test_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.05, 0.001, 0.25, 1.5, 2, 59, 61, 120, 3600, 86400])
def test_format_round_trips(seconds: float) -> None:
    assert math.isclose(parse_duration(format_duration(seconds)), seconds)
