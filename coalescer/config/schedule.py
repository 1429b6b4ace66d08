"""A touch's own time: ``at`` (an aware datetime, epoch seconds, or ISO-8601 text) or
``delay`` (seconds, or a duration string such as "30m"), checked and turned into the
form an upsert call carries.

The wire form is ``a<epoch ms>`` for an absolute time, ``d<ms>`` for a delay (Redis adds
its own clock at the write); the absorber appends ``+`` when a plain touch of the key
followed the scheduled one before both were written (the plain touch then decides the
due time, see store/lua/upsert.lua). A schedule replaces the key's burst, and the
items it had with it, unless ``keep_items`` puts a ``k`` before that ``+``. Which
times are refused (InvalidScheduleError naming the key and the value; nothing of the
call is applied) is ``Coalescer.touch``'s docstring's; ``ahead`` is the rules file's
``limits.max_schedule_ahead`` (``HORIZON`` when no rules file says).
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

from coalescer.config.durations import MAX_TEXT, format_duration, parse_duration
from coalescer.errors import InvalidScheduleError

HORIZON = 10 * 365 * 86_400.0  # seconds: no touch is scheduled further ahead (10 years)
HORIZON_TEXT = "10 years"
THEN_PLAIN = "+"  # a plain touch of the key followed its scheduled one
KEEP_ITEMS = "k"  # the key keeps the items it had (a schedule replaces them otherwise)
AT_FORMS = ("an aware datetime, epoch seconds (int or float), or ISO-8601 text with an "
            "offset (2026-12-05T12:00:00+00:00)")
DELAY_FORMS = 'seconds >= 0 (int or float) or a duration string ("30m", "1.5s", "2h")'

At = datetime | int | float | str
Delay = int | float | str


def schedule_spec(key: str, at: At | None = None, delay: Delay | None = None, *,
                  ahead: float = HORIZON, keep_items: bool = False) -> str | None:
    """The wire form of a touch's time; None for a plain touch (neither given).
    InvalidScheduleError when it is refused (``ahead``: seconds ahead at most).
    ``keep_items``: the key keeps the items it had (a schedule drops them otherwise)."""
    spec = _spec(key, at, delay, ahead)
    return spec + KEEP_ITEMS if spec is not None and keep_items else spec


def _spec(key: str, at: At | None, delay: Delay | None, ahead: float) -> str | None:
    if at is None and delay is None:
        return None
    if at is not None and delay is not None:
        raise InvalidScheduleError(key, f"at={at!r}, delay={delay!r}",
                                   "give at or delay, not both")
    if at is not None:
        return f"a{at_ms(key, at, ahead)}"
    assert delay is not None
    return f"d{delay_ms(key, delay, ahead)}"


def at_ms(key: str, at: object, ahead: float = HORIZON) -> int:
    """Epoch milliseconds of ``at`` (see AT_FORMS), checked against the epoch and
    ``ahead``."""
    seconds = _at_seconds(key, at)
    if seconds < 0:
        raise InvalidScheduleError(key, at, f"{_iso(seconds)} is before the epoch "
                                   "(1970-01-01T00:00:00Z): a time is at or after it")
    if seconds - time.time() > ahead:
        raise InvalidScheduleError(key, at, f"{_iso(seconds)} is {_ahead_text(ahead)}")
    return round(seconds * 1000)


def _iso(seconds: float) -> str:
    """``seconds`` since the epoch as ISO-8601 UTC text (past year 9999: the number)."""
    try:
        return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)).isoformat()
    except OverflowError:
        return f"{seconds:.0f} epoch seconds"


def _ahead_text(ahead: float) -> str:
    """Why a time is refused for lying too far ahead, naming the limit."""
    if ahead == HORIZON:
        return f"more than {HORIZON_TEXT} ahead"
    return (f"more than limits.max_schedule_ahead ({format_duration(ahead)}) ahead of "
            "now; set a higher limits.max_schedule_ahead in the rules file to allow it")


def _at_seconds(key: str, at: object) -> float:
    if isinstance(at, datetime):
        if at.tzinfo is None or at.utcoffset() is None:
            raise InvalidScheduleError(key, at, "a naive datetime (no time zone): give an "
                                       "aware one, e.g. datetime.now(timezone.utc)")
        return at.timestamp()
    if isinstance(at, str):
        return _text_seconds(key, at)
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise InvalidScheduleError(key, at, f"not a time: expected {AT_FORMS}")
    if not math.isfinite(at) or at < 0:
        raise InvalidScheduleError(key, at, "epoch seconds must be a finite number >= 0")
    return float(at)


def _text_seconds(key: str, text: str) -> float:
    """Epoch seconds of ``text``: a number of epoch seconds, or ISO-8601 with an offset.
    A text longer than MAX_TEXT characters is refused by its length, unread."""
    if len(text) > MAX_TEXT:
        raise InvalidScheduleError(key, text, f"longer than {MAX_TEXT} characters: "
                                   f"expected {AT_FORMS}")
    stripped = text.strip()
    try:
        number = float(stripped)
    except ValueError:
        pass
    else:
        return _at_seconds(key, number) if math.isfinite(number) else _unreadable(key, text)
    try:
        parsed = datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        return _unreadable(key, text)
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise InvalidScheduleError(key, text, "a naive datetime (no offset): give one, e.g. "
                                   "2030-01-01T12:00:00+00:00")
    return _at_seconds(key, parsed)


def _unreadable(key: str, text: str) -> float:
    raise InvalidScheduleError(key, text, f"not a time: expected {AT_FORMS}")


def delay_ms(key: str, delay: object, ahead: float = HORIZON) -> int:
    """Milliseconds of ``delay`` (see DELAY_FORMS), checked against ``ahead``."""
    if isinstance(delay, str) and len(delay) > MAX_TEXT:
        raise InvalidScheduleError(key, delay, f"longer than {MAX_TEXT} characters: "
                                   f"expected {DELAY_FORMS}")
    if isinstance(delay, str) and delay.strip().startswith("-"):
        raise InvalidScheduleError(key, delay, "a negative delay: a delay is >= 0")
    try:
        seconds = parse_duration(delay)
    except ValueError:
        if isinstance(delay, int | float) and not isinstance(delay, bool) and delay < 0:
            raise InvalidScheduleError(key, delay, "a negative delay: a delay is >= 0") from None
        raise InvalidScheduleError(key, delay, f"not a delay: expected {DELAY_FORMS}") from None
    if seconds > ahead:
        raise InvalidScheduleError(key, delay, f"{format_duration(seconds)} is "
                                   f"{_ahead_text(ahead)}")
    return round(seconds * 1000)


def then_plain(spec: str) -> str:
    """``spec`` followed by a plain touch of its key."""
    return spec if spec.endswith(THEN_PLAIN) else spec + THEN_PLAIN
