"""Durations in rules files: a number of seconds, or a string with ms, s, m or h."""

from __future__ import annotations

import math
import re

_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(
    r"\s*(?P<sign>-\s*)?(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|m|h)?\s*")
ACCEPTED = (
    'a number of seconds >= 0 (e.g. 2 or 0.25), or a string with a unit: '
    '"50ms", "2s", "1.5s", "5m", "2h"'
)


class NegativeDurationError(ValueError):
    """A duration below zero, such as -5 or "-2s"."""


def parse_duration(value: object) -> float:
    """Seconds from an int/float >= 0 or a string such as "50ms", "2s", "5m", "2h"."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: expected {ACCEPTED}")
    if isinstance(value, int | float):
        return _checked(float(value), value)
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value)
        if match is not None:
            unit = match.group("unit") or "s"
            sign = -1.0 if match.group("sign") else 1.0
            return _checked(sign * float(match.group("num")) * _UNITS[unit], value)
    raise ValueError(f"bad duration {value!r}: expected {ACCEPTED}")


def _checked(seconds: float, value: object) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"bad duration {value!r}: expected {ACCEPTED}")
    if seconds < 0:
        raise NegativeDurationError(f"negative duration {value!r}: a duration is never below "
                                    f"0; expected {ACCEPTED}")
    return seconds + 0.0  # -0.0 is 0


def format_duration(seconds: float) -> str:
    """A short form that parse_duration reads back: 0.05 -> "50ms", 120 -> "2m"."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    millis = round(seconds * 1000.0, 6)
    value, unit = _unit(millis)
    return f"{_number(value)}{unit}"


def _unit(millis: float) -> tuple[float, str]:
    if millis < 1000:
        return millis, "ms"
    if millis % 3_600_000 == 0:
        return millis / 3_600_000, "h"
    if millis % 60_000 == 0:
        return millis / 60_000, "m"
    return millis / 1000, "s"


def _number(value: float) -> str:
    return f"{value:.6f}".rstrip("0").rstrip(".")
