"""What a failed write means, and what a dropped key is recorded as.

A failed write is one of three things:

- ``KEY``: Redis (or the client encoding it) refused something about one key (a
  WRONGTYPE on the key's own data, a value that cannot be encoded, a script error
  on the key's state). The batch is split until that key is found, and it alone is
  dropped. Only the replies and errors listed here are KEY.
- ``REFUSED``: Redis answered an error reply that is about the server, not any key
  (MISCONF, READONLY, OOM, NOREPLICAS, NOPERM, BUSY, LOADING, MASTERDOWN, and every
  reply not listed as KEY): the touches stay buffered and are retried; the episode is
  logged and reported (see write/refusals.py).
- ``UNREACHED``: the connection failed, timed out, or a cluster redirection or layout
  change asks for another try: retried too.

redis-py maps some replies to classes of its own and keeps their code in
``status_code`` (older versions stripped it): ``reply_code`` reads either.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Literal

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    DataError,
    ExecAbortError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.errors import (
    CoalescerError,
    LayoutMovedError,
    RedisRefusesWritesError,
    RedisUnreachableError,
)

Fault = Literal["key", "refused", "unreached"]
KEY: Fault = "key"
REFUSED: Fault = "refused"
UNREACHED: Fault = "unreached"

UNKNOWN_CODE = "UNKNOWN"  # the code of a reply whose first word is not one

# Replies about a key's own data (a WRONGTYPE on it, a value Redis refuses): the key
# is dropped. Matched on the code, then on the text of a reply coded ERR or none.
KEY_CODES = frozenset({"WRONGTYPE"})
KEY_TEXTS = ("wrong kind of value", "value is not an integer", "value is not a valid float",
             "exceeds maximum allowed size")
# A Lua runtime error of the script itself ("user_script:12: attempt to ... "), met on a
# key's corrupted state; not the "on @user_script:12." every error inside a script ends with.
_SCRIPT_ERROR = re.compile(r"(?<!@)user_script:\d+:")
# Errors the client raises before sending: the key or item could not be encoded.
_KEY_TYPES = (UnicodeError, DataError, ValueError, TypeError)

# The code of each reply redis-py turns into a class of its own (most specific first).
_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (BusyLoadingError, "LOADING"), (ReadOnlyError, "READONLY"), (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"), (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"), (TryAgainError, "TRYAGAIN"),
    (ExecAbortError, "EXECABORT"),
)
# Replies that ask for another try at once (a slot moving, a cluster electing).
_RETRY_CODES = frozenset({"TRYAGAIN", "CLUSTERDOWN", "ASK", "MOVED"})
_UNREACHED_TYPES = (RedisConnectionError, RedisTimeoutError, OSError, AskError,
                    RedisClusterException, LayoutMovedError)

REASON_INVALID = "invalid_key"  # the client could not encode it
REASON_REDIS = "redis_error"  # Redis answered an error for it
REASON_OTHER = "other"


def reply_code(exc: BaseException) -> str | None:
    """The code of an error reply ("MISCONF", "READONLY", ...; UNKNOWN_CODE for a reply
    without one), or None for an error that is not a reply."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    for cls, mapped in _CODES:
        if isinstance(exc, cls):
            return mapped
    if not isinstance(exc, ResponseError):
        return None
    first = str(exc).split(" ", 1)[0]
    return first if first.isupper() and first.isalpha() else UNKNOWN_CODE


def reply_text(exc: BaseException) -> str:
    """The reply's text with its code in front (redis-py strips it for some), on one line."""
    text = " ".join(str(exc).split())
    code = reply_code(exc)
    if code is None or code == UNKNOWN_CODE or text.startswith(code):
        return text
    return f"{code} {text}"


def _key_reply(code: str | None, exc: BaseException) -> bool:
    if code in KEY_CODES:
        return True
    if code not in (None, "ERR", UNKNOWN_CODE):
        return False
    text = str(exc)
    return any(part in text for part in KEY_TEXTS) or bool(_SCRIPT_ERROR.search(text))


def classify(exc: BaseException) -> Fault:
    """What a failed write's error means for its keys (see the module's docstring)."""
    if not isinstance(exc, Exception):
        return UNREACHED  # cancelled, or the process is exiting: give the keys back
    code = reply_code(exc)
    if code is not None and code not in _RETRY_CODES and not isinstance(exc, AskError):
        return KEY if _key_reply(code, exc) else REFUSED
    if code is not None or isinstance(exc, _UNREACHED_TYPES):
        return UNREACHED
    if isinstance(exc, _KEY_TYPES):
        return KEY
    return REFUSED if isinstance(exc, RedisError) else UNREACHED


def is_transient(exc: BaseException) -> bool:
    """True for an error that a retry of the same write may not meet (every one but
    an error about a key)."""
    return classify(exc) != KEY


def write_error(exc: BaseException) -> BaseException:
    """The coalescer error ``flush()`` raises for a write that failed with ``exc``."""
    if isinstance(exc, (CoalescerError, asyncio.CancelledError)):
        return exc
    code = reply_code(exc)
    if code is not None or classify(exc) == REFUSED:  # an error reply, whatever it says
        return RedisRefusesWritesError(code or UNKNOWN_CODE, reply_text(exc))
    detail = " ".join(str(exc).split()) or "no detail"
    return RedisUnreachableError(f"Redis could not be reached: {type(exc).__name__}: {detail}")


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
