"""Which write errors are worth retrying, and what a dropped key is recorded as.

A transient error (the connection, a timeout, a server loading its data set or in a
failover, a full memory that may free up) says nothing about the keys: the write is
retried until it succeeds. Any other error is permanent: the batch is split until the
keys Redis refuses are found, and those alone are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.exceptions import (
    AskError,
    ClusterError,
    DataError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.errors import LayoutMovedError

# Error replies that a later try may not get: redis-py raises its own class for most
# (LOADING is a ConnectionError, MASTERDOWN and CLUSTERDOWN are ClusterErrors) and
# strips their code; the others keep theirs as the first word.
TRANSIENT_REPLIES = ("BUSY", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN", "LOADING")
_TRANSIENT_TYPES = (RedisConnectionError, RedisTimeoutError, OSError, ClusterError,
                    RedisClusterException, ReadOnlyError, TryAgainError, OutOfMemoryError,
                    AskError, LayoutMovedError)

REASON_INVALID = "invalid_key"  # the client could not encode it
REASON_REDIS = "redis_error"  # Redis answered an error for it
REASON_OTHER = "other"


def is_transient(exc: BaseException) -> bool:
    """True for an error that a retry of the same write may not meet."""
    if not isinstance(exc, Exception):
        return True  # cancelled, or the process is exiting: give the keys back
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    return isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in TRANSIENT_REPLIES


def drop_reason(exc: BaseException) -> str:
    """The ``reason`` label of a key dropped for ``exc``."""
    if isinstance(exc, (UnicodeError, DataError)):
        return REASON_INVALID
    if isinstance(exc, ResponseError):
        return REASON_REDIS
    return REASON_OTHER


@dataclass(frozen=True, slots=True)
class DroppedKey:
    """A touched key that could never be written, and why."""

    key: str
    reason: str
    error: str
    at: float  # wall clock, seconds

    @classmethod
    def now(cls, key: str, reason: str, error: str) -> DroppedKey:
        return cls(key, reason, error, time.time())

    def as_json(self) -> dict[str, object]:
        return {"key": self.key, "reason": self.reason, "error": self.error,
                "at": round(self.at, 3)}
