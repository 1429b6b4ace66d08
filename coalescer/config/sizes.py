"""Sizes in rules files: a whole number of bytes, or a string with a unit (``"512MiB"``,
``"1GB"``). A string longer than ``MAX_TEXT`` characters is refused unread; the one
pattern that reads a shorter one has no two parts that can match the same characters."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {"": 1, "B": 1, "kB": 1000, "KB": 1000, "KiB": 1024,
                          "MB": 1000**2, "MiB": 1024**2, "GB": 1000**3, "GiB": 1024**3,
                          "TB": 1000**4, "TiB": 1024**4}
_SIZE_RE = re.compile(r"(?P<num>\d+)\s*(?P<unit>[A-Za-z]*)")
MAX_TEXT = 32
ACCEPTED = 'a whole number of bytes, or a string with a unit: "64MiB", "1GiB", "500MB"'


def parse_size(value: object) -> int:
    """Bytes from an int >= 0 or a string such as "64MiB"; ValueError naming the value."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and len(value) <= MAX_TEXT:
        match = _SIZE_RE.fullmatch(value.strip())
        if match is not None and match.group("unit") in _UNITS:
            return int(match.group("num")) * _UNITS[match.group("unit")]
    shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else \
        f"{value[:40]!r}... ({len(value)} characters)"
    raise ValueError(f"bad size {shown}: expected {ACCEPTED}")


def format_size(size: int) -> str:
    """A short form that parse_size reads back: 1073741824 -> "1GiB"."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"
