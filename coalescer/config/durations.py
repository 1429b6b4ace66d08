"""Durations in rules files: a number of seconds, or a string with ms, s, m, h or d.

A string longer than ``MAX_TEXT`` characters is refused by its length before anything
reads it, and the one pattern that reads a shorter one has no two parts that can match
the same characters: reading a duration costs time linear in its length, and bounded."""

from __future__ import annotations

import math
import re

_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# Read after the text is stripped, so no two repeats can share characters.
_DURATION_RE = re.compile(
    r"(?P<sign>-\s*)?(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|m|h|d)?")
MAX_TEXT = 64  # characters: a longer duration string is refused unread
ACCEPTED = (
    'a number of seconds >= 0 (e.g. 2 or 0.25), or a string with a unit: '
    '"50ms", "2s", "1.5s", "5m", "2h", "1d"'
)


class NegativeDurationError(ValueError):
    """A duration below zero, such as -5 or "-2s"."""


def parse_duration(value: object) -> float:
    """Seconds from an int/float >= 0 or a string such as "50ms", "2s", "5m", "2h", "1d"."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: expected {ACCEPTED}")
    if isinstance(value, int | float):
        return _checked(float(value), value)
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise ValueError(f"bad duration {shown(value)}: longer than {MAX_TEXT} "
                             f"characters; expected {ACCEPTED}")
        match = _DURATION_RE.fullmatch(value.strip())
        if match is not None:
            unit = match.group("unit") or "s"
            sign = -1.0 if match.group("sign") else 1.0
            return _checked(sign * float(match.group("num")) * _UNITS[unit], value)
    raise ValueError(f"bad duration {value!r}: expected {ACCEPTED}")


def shown(value: str, limit: int = 40) -> str:
    """``repr(value)``, cut short for a long string (with its length)."""
    if len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return repr(value)


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
    if millis % 86_400_000 == 0:
        return millis / 86_400_000, "d"
    if millis % 3_600_000 == 0:
        return millis / 3_600_000, "h"
    if millis % 60_000 == 0:
        return millis / 60_000, "m"
    return millis / 1000, "s"


def _number(value: float) -> str:
    return f"{value:.6f}".rstrip("0").rstrip(".")
