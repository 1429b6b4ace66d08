"""Judging another holder's lease by this process's own clock.

Leases are written as server times (the Redis host's ``TIME``): a claim's lease ends at
the score its holder last renewed it to, a node's lease at its entry in the leases set.
Reading "ends before the server's now" as "lapsed" trusts the Redis host's clock: a
forward step of it would expire every live lease at once, a backward step would keep a
dead holder's lease for as long as the step. So a lease is taken over here only once
its holder has not renewed it for a full lease *as this process measures time*:

* ``Sightings`` remembers, per holder, the value its lease had and when (this process's
  monotonic clock) that value was first read. A renewal always writes a new value, so an
  unchanged value since ``first_seen`` means no renewal since at least then.
* ``ServerClock`` maps server times to this process's clock through the offset every
  answer carrying the server's time gives (the middle of the call), and notices when
  that offset jumps (``stepped_at``): the server's clock was stepped.

When the holder renewed, as this process's clock says, is then taken as late as is
known for sure: the server time of the renewal mapped to this clock, never earlier than
the last step seen (a renewal before a step maps wrongly) and never later than
``first_seen`` (it renewed before anyone read the value). Without a step that is the
renewal itself, and a dead holder is taken over one lease after it; across a step
it is at worst ``first_seen``: one lease after the value was first read, never sooner.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

STEP_TOLERANCE_MS = 25.0  # an offset change beyond this plus the calls' spread is a step
MARGIN = 0.025  # seconds added to every lease judged here: scheduling and drift

Name = TypeVar("Name", bound=Hashable)


class ServerClock:
    """The server's clock against this process's monotonic clock (seconds)."""

    def __init__(self) -> None:
        self._offset_ms: float | None = None  # server ms minus local ms
        self._spread_ms = 0.0  # half the round trip of the call the offset came from
        self.stepped_at = -math.inf  # local time of the last answer that found a step
        self.steps = 0

    @property
    def known(self) -> bool:
        return self._offset_ms is not None

    def observe(self, sent: float, got: float, server_ms: float) -> None:
        """A call sent at ``sent`` and answered at ``got`` (local seconds) read the
        server's clock as ``server_ms``."""
        spread = max(0.0, got - sent) * 500
        offset = server_ms - (sent + got) * 500
        before = self._offset_ms
        if before is not None and abs(offset - before) > (
                STEP_TOLERANCE_MS + spread + self._spread_ms):
            self.stepped_at = got
            self.steps += 1
            log.warning("the Redis server's clock stepped by %+.0f ms against this node's; "
                        "leases are judged by this node's clock for a while",
                        offset - before)
        self._offset_ms, self._spread_ms = offset, spread

    def local(self, server_ms: float) -> float:
        """The local time of a server time (the offset of the last answer)."""
        assert self._offset_ms is not None
        return (server_ms - self._offset_ms) / 1000

    def renewed_at(self, renewed_ms: float, first_seen: float) -> float:
        """When a holder whose renewal wrote server time ``renewed_ms`` (a value first
        read at ``first_seen``) renewed, on this clock, as late as known for sure."""
        if self._offset_ms is None:
            return first_seen
        return min(first_seen, max(self.local(renewed_ms), self.stepped_at))

    def margin(self) -> float:
        """Seconds a judged lease is given beyond its length: the uncertainty of the
        mapping, plus scheduling."""
        return MARGIN + (STEP_TOLERANCE_MS + 2 * self._spread_ms) / 1000

    def stepped_within(self, seconds: float, now: float) -> bool:
        return now - self.stepped_at < seconds


class Sightings(Generic[Name]):
    """When this process first read each holder's current lease value."""

    def __init__(self) -> None:
        self._seen: dict[Name, tuple[float, float]] = {}  # name -> (value, first seen)

    def see(self, values: Mapping[Name, float], now: float, *,
            forget_missing: bool = True) -> dict[Name, float]:
        """Record a read of ``values`` made at ``now``; returns when each was first seen.
        Names not in ``values`` are forgotten unless ``forget_missing`` is False."""
        seen = self._seen
        out: dict[Name, float] = {}
        for name, value in values.items():
            old = seen.get(name)
            first = old[1] if old is not None and old[0] == value else now
            seen[name] = (value, first)
            out[name] = first
        if forget_missing and len(seen) > len(values):
            for name in [n for n in seen if n not in values]:
                del seen[name]
        return out

    def peek(self, values: Mapping[Name, float], now: float) -> dict[Name, float]:
        """When each of ``values`` was first seen, as ``see`` would say, recording nothing."""
        seen = self._seen
        return {name: old[1] if (old := seen.get(name)) is not None and old[0] == value
                else now for name, value in values.items()}

    def clear(self) -> None:
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._seen)
