"""Episodes of Redis refusing writes (MISCONF, READONLY, OOM, NOPERM, ...).

While Redis answers writes with an error reply that is not about a key, the touches
stay buffered and are retried (see write/failures.py). An episode starts with the
first such reply and ends with the first write Redis takes again: its start is
logged once with the reply's text (again only if the reply changes), its end once
with how long it lasted; every refused write is counted by code, and ``reason``
says what /healthz and BackpressureError show while it lasts.
"""

from __future__ import annotations

import logging
import time

from coalescer.common.metrics import Metrics
from coalescer.common.plural import plural
from coalescer.write.failures import UNKNOWN_CODE, reply_code, reply_text

log = logging.getLogger(__name__)


class Refusals:
    """Tracks the current episode of refused writes, if any."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._reply: str | None = None  # the text of the last refusal of this episode
        self._since = 0.0  # time.monotonic() of the episode's first refusal
        self._count = 0  # writes refused in this episode

    @property
    def reason(self) -> str | None:
        """"Redis refuses writes: <reply>" while an episode lasts, else None."""
        return None if self._reply is None else f"Redis refuses writes: {self._reply}"

    def refused(self, exc: BaseException) -> None:
        """A write was refused with ``exc``: count it, and log it if it starts an
        episode or its reply differs from the episode's."""
        code = reply_code(exc) or UNKNOWN_CODE
        text = reply_text(exc)
        self._metrics.refused_writes.labels(code).inc()
        self._metrics.refusing_writes.set(1)
        self._count += 1
        if self._reply is None:
            self._since = time.monotonic()
        if text != self._reply:
            log.error("Redis refuses writes: %s; the touches stay buffered and are "
                      "retried until it takes them", text)
        self._reply = text

    def taken(self) -> None:
        """Redis took a write: an episode, if one lasted, ends here."""
        if self._reply is None:
            return
        log.warning("Redis takes writes again after %.1f s (%s refused)",
                    time.monotonic() - self._since, plural(self._count, "write"))
        self._reply, self._count = None, 0
        self._metrics.refusing_writes.set(0)
