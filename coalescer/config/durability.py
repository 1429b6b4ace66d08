"""The rules file's ``durability:`` setting: how many replicas must hold a write before
it counts (``flush()`` returns, a node runs a claim or records an ack)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_REPLICAS = 16  # replicas a write may wait for, at most
MAX_TIMEOUT = 5.0  # seconds a write waits for its replicas, at most (below the socket timeout)
DEFAULT_TIMEOUT = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Durability:
    """``replicas``: how many replicas must acknowledge each write (0: none, no WAIT is
    sent); ``timeout``: how long a write waits for them (seconds)."""

    replicas: int = 0
    timeout: float = DEFAULT_TIMEOUT

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout * 1000))


NO_REPLICAS = Durability()
