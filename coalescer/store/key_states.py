"""A key's state as its shard's meta hash holds it (written by the Lua scripts).

    pending  "FIRST|DUE|LAST|ATTEMPTS|COUNT"   FIRST in lowercase hex, DUE and LAST as
             offsets from it; LAST and ATTEMPTS left out while zero and COUNT (the
             burst's touches) while one (an older
             "P|FIRST|LAST|ATTEMPTS|DUE" is read too); an "S" in front marks a due
             time set by a touch's own time (``at``/``delay``), whose FIRST and DUE
             offset are then written in base 36; "!PRIORITY" at the end (base 36 ms)
             is the burst's priority, the largest its touches gave
    running  "R|TOKEN|FIRST|LAST|ATTEMPT|DUE|RDUE|RFIRST|RLAST|NODE" (RDUE "S"-prefixed
             when the touch it re-arms had a time of its own, "!PRIORITY" after it when
             those touches gave a priority)
    dead     "D|FIRST|LAST|ATTEMPTS|ERROR"

Times are server-clock epoch milliseconds. store/lua/_lib.lua writes and reads the same forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PENDING = re.compile(
    r"([0-9a-f]+)\|(-?\d+)(?:\|(-?\d+)(?:\|(\d+)(?:\|(\d+))?)?)?(?:!([0-9a-z]+))?")
_SCHEDULED = re.compile(
    r"S([0-9a-z]+)\|(-?[0-9a-z]+)(?:\|(-?\d+)(?:\|(\d+)(?:\|(\d+))?)?)?(?:!([0-9a-z]+))?")


@dataclass(frozen=True, slots=True)
class Pending:
    """A pending key: its burst's first and last touch, tries so far, and due time."""

    first_ms: int
    last_ms: int
    attempts: int
    due_ms: int
    scheduled: bool = False  # the due time is a touch's own time (at/delay)
    touches: int = 1  # the burst's touches that reached Redis
    priority_ms: int = 0  # the largest priority the burst's touches gave (0: none)


def kind(value: str | None) -> str:
    """"pending", "running", "dead", or "idle" (no state)."""
    if not value:
        return "idle"
    return {"R": "running", "D": "dead"}.get(value[0], "pending")


def fields(value: str, n: int) -> list[str]:
    """The first ``n`` fields after the kind letter of a running, dead or older pending state
    (missing ones empty)."""
    parts = value[2:].split("|", n - 1)
    return parts + [""] * (n - len(parts))


def _num(text: str) -> int:
    return int(text) if text.lstrip("-").isdigit() else 0


def pending(value: str) -> Pending | None:
    """A pending state's fields; None when ``value`` is not a readable pending state."""
    if value.startswith("P|"):
        first, last, attempts, due = (_num(f) for f in fields(value, 4))
        return Pending(first_ms=first, last_ms=last, attempts=attempts, due_ms=due)
    scheduled = value.startswith("S")
    found = (_SCHEDULED if scheduled else _PENDING).fullmatch(value)
    if found is None:
        return None
    first_text, due_off, last_off, tries, count, prio = found.groups()
    start = int(first_text, 36 if scheduled else 16)
    return Pending(first_ms=start, last_ms=start + int(last_off or 0),
                   attempts=int(tries or 0),
                   due_ms=start + int(due_off, 36 if scheduled else 10), scheduled=scheduled,
                   touches=int(count or 1), priority_ms=int(prio, 36) if prio else 0)
