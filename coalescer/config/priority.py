"""A touch's own priority (``touch(key, priority="30s")``): checked, and its wire form
inside a touch's time (config/schedule.py; store/lua/upsert.lua reads it).

A touch's time in its wire form is "a<ms>" or "d<ms>", then "k" (keep items), then
"+" (a plain touch followed). A priority adds "p<ms>" before the "+": "d5000p30000",
or "p30000" alone for a plain touch with a priority. The buffer keeps one such string
per key: a later time replaces the earlier one, and the priority kept is the largest
of the touches' (``merged``).
"""

from __future__ import annotations

import re
from datetime import timedelta

from coalescer.config.durations import parse_duration
from coalescer.config.fair import MAX_PRIORITY
from coalescer.config.model import Rule
from coalescer.errors import InvalidPriorityError

Priority = timedelta | int | float | str
FORMS = 'seconds >= 0 (int or float), a timedelta, or a duration string ("30s", "2m")'
_WIRE = re.compile(r"(.*?)(?:p(\d+))?(\+?)")
THEN_PLAIN = "+"


def priority_ms(key: str, priority: object, rule: Rule) -> int:
    """Milliseconds of a touch's ``priority`` for ``key`` of ``rule``; InvalidPriorityError
    names the key, the value and why it was refused."""
    if rule.fair is None and rule.priority is None:
        raise InvalidPriorityError(key, priority, f"rule {rule.name!r} orders its due keys "
                                   "by due time only: give it a priority: (e.g. 0s) or "
                                   "fair: to order them by priority")
    value = priority.total_seconds() if isinstance(priority, timedelta) else priority
    negative = (isinstance(value, str) and value.strip().startswith("-")) or (
        isinstance(value, int | float) and not isinstance(value, bool) and value < 0)
    if negative:
        raise InvalidPriorityError(key, priority, "negative: a priority is >= 0")
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise InvalidPriorityError(key, priority, f"not a priority: expected {FORMS}") from None
    if seconds > MAX_PRIORITY:
        raise InvalidPriorityError(key, priority, "more than a year and a day")
    return round(seconds * 1000)


def with_priority(spec: str | None, ms: int | None) -> str | None:
    """A touch's time ``spec`` (None: a plain touch) with priority ``ms`` (None: none)."""
    if ms is None:
        return spec
    return f"{spec or ''}p{ms}"


def split(spec: str) -> tuple[str, int | None, str]:
    """A wire form's time part (with its "k"), priority ms (None: none) and "+" mark."""
    found = _WIRE.fullmatch(spec)
    assert found is not None  # every string matches
    time, ms, plus = found.groups()
    return time, int(ms) if ms is not None else None, plus


def merged(old: str | None, new: str) -> str:
    """The buffered wire form after a touch ``new`` of a key buffered with ``old``: a new
    time replaces the old one (a touch without one is a plain touch after it), and the
    priority is the larger of the two."""
    if old is None or ("p" not in old and "p" not in new):
        return new
    old_time, old_ms, _ = split(old)
    new_time, new_ms, new_plus = split(new)
    ms = max(old_ms or 0, new_ms or 0) if old_ms is not None or new_ms is not None else None
    if new_time:
        time, plus = new_time, new_plus
    else:
        time, plus = old_time, THEN_PLAIN if old_time else ""
    return (with_priority(time, ms) or "") + plus


def with_older(newer: str, older: str) -> str:
    """``newer`` (buffered since) keeping the larger priority of the two: what an unwritten
    ``older`` time goes back to the buffer as."""
    if "p" not in older:
        return newer
    time, ms, plus = split(newer)
    _, old_ms, _ = split(older)
    return (with_priority(time, max(ms or 0, old_ms or 0)) or "") + plus
