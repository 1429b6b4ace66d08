"""Every exception coalescer raises on purpose, in one place."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from redis.exceptions import AuthenticationError as _RedisAuthenticationError
from redis.exceptions import ConnectionError as _RedisConnectionError


class CoalescerError(Exception):
    """Base class of coalescer's own errors."""


class ConfigError(CoalescerError):
    """A rules file that cannot be used, with the file, line and field at fault."""

    def __init__(self, message: str, *, file: str = "<rules>", line: int | None = None,
                 field: str | None = None) -> None:
        self.file = file
        self.line = line
        self.field = field
        message = " ".join(message.split())  # one line, whatever went into it
        self.message = message
        where = file if line is None else f"{file}:{line}"
        what = f"{field}: " if field else ""
        super().__init__(f"{where}: {what}{message}")
        self.errors: list[ConfigError] = [self]  # every problem found; see combine()

    @classmethod
    def combine(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error carrying every one of ``errors`` in ``.errors``: the first one's file,
        line and field, and one line per error in its text."""
        if len(errors) == 1:
            return errors[0]
        first = errors[0]
        combined = cls(first.message, file=first.file, line=first.line, field=first.field)
        combined.errors = list(errors)
        combined.args = ("\n".join(str(error) for error in errors),)
        return combined


class KeyRefusedError(CoalescerError, KeyError):
    """A touched key that was refused: nothing of that touch was applied."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(key)


class UnknownKeyError(KeyRefusedError):
    """A touched key that matches no rule.

    ``rules_file`` is the rules file the key was looked up in (None for rules not read
    from a file). ``near`` has one ``(text, name)`` per rule: the text the key is
    compared with to find the closest rule, and how the message names that rule.
    """

    def __init__(self, key: str, *, rules_file: str | None = None,
                 near: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(key)
        self.rules_file = rules_file
        self.near = near

    def closest(self) -> str | None:
        """How the rule most like the key is named; None when none is much alike."""
        compared = difflib.SequenceMatcher(None, self.key[:CLOSEST_CHARS])
        best, found = -1.0, None
        for text, name in self.near:  # a rule that cannot beat the best is not scored
            compared.set_seq2(text)
            floor = max(best, CLOSE_ENOUGH)
            if compared.real_quick_ratio() < floor or compared.quick_ratio() < floor:
                continue
            ratio = compared.ratio()
            if ratio > best:
                best, found = ratio, name
        return found if best >= CLOSE_ENOUGH else None

    def __str__(self) -> str:
        where = f" in {self.rules_file}" if self.rules_file else ""
        closest = self.closest()
        hint = f" (closest: {closest})" if closest else ""
        return f"no rule{where} matches key {self.key!r}{hint}"


CLOSE_ENOUGH = 0.6  # how alike (0 to 1, difflib's ratio) a rule must be to be suggested
CLOSEST_CHARS = 200  # of a key, compared with the rules (bounds the cost of a long key)


class InvalidKeyError(KeyRefusedError):
    """A touched key that Redis cannot store (not UTF-8, a NUL character, too long)."""

    def __init__(self, key: str, reason: str) -> None:
        self.reason = reason
        super().__init__(key)

    def __str__(self) -> str:
        return f"key {shown_key(self.key)} cannot be stored: {self.reason}"


class InvalidItemError(KeyRefusedError):
    """A touch's item that was refused (not a str, empty, too long, a NUL character, or
    a key whose rule takes no items): nothing of that touch was applied."""

    def __init__(self, key: str, item: object, reason: str) -> None:
        self.item = item
        self.reason = reason
        super().__init__(key)

    def __str__(self) -> str:
        return (f"item {shown_key(self.item)} of key {shown_key(self.key)} cannot be "
                f"touched: {self.reason}")


class InvalidScheduleError(CoalescerError, ValueError):
    """A touch's time (``at`` or ``delay``) that was refused: unparsable, a naive
    datetime, a negative delay, both given, or beyond the horizon. Nothing of the call
    that carried it was applied."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(key, value, reason)

    def __str__(self) -> str:
        return (f"time {shown_key(self.value)} of the touch of key {shown_key(self.key)} "
                f"refused: {self.reason}")


class InvalidPriorityError(InvalidScheduleError):
    """A touch's ``priority`` that was refused: not a duration, negative, beyond a year
    and a day, or for a rule that neither is fair nor has a ``priority:``. Nothing of
    the call that carried it was applied."""

    def __str__(self) -> str:
        return (f"priority {shown_key(self.value)} of the touch of key "
                f"{shown_key(self.key)} refused: {self.reason}")


def shown_key(key: object, limit: int = 80) -> str:
    """``repr(key)``, cut short for a very long key."""
    if isinstance(key, str) and len(key) > limit:
        return f"{key[:limit]!r}... ({len(key)} characters)"
    return repr(key)


class BackpressureError(CoalescerError):
    """The in-process buffer is full: the touch was not accepted."""


class QuotaExceededError(BackpressureError):
    """The keys waiting for their refresh reached the rules file's ``limits.pending_keys``
    (or the bytes they hold ``limits.pending_bytes``): the touch was not accepted (every
    touch already accepted stays). ``limit`` names the limit, ``retry_after`` is when to
    try again (seconds)."""

    def __init__(self, message: str, *, limit: str, value: int, retry_after: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value
        self.retry_after = retry_after


class RedisWriteError(CoalescerError):
    """``flush()`` could not write every touch to Redis; the touches stay buffered and
    are written once Redis takes them (unless the coalescer closes first)."""


class RedisUnreachableError(RedisWriteError):
    """Redis could not be reached (refused connection, timeout, reset)."""


class RedisConnectError(RedisUnreachableError, _RedisConnectionError):
    """Redis could not be reached by a call (start, a read, cancel), with what to
    check: "could not connect to URL: connection refused (is a Redis server listening
    there?)". Raised from redis-py's own error, and one still (a ConnectionError)."""


class RedisAuthenticationError(CoalescerError, _RedisAuthenticationError):
    """The Redis server refused the password of the URL, or wants one it lacks; the
    message says which and how to give it. Raised from redis-py's own error, and one
    still (an AuthenticationError)."""


class RedisUrlError(ConfigError, ValueError):
    """A Redis URL that cannot work (no scheme, an unreadable port, a password with an
    unencoded '/'): ``file`` names where it came from (``redis_url`` or
    ``$COALESCER_REDIS_URL``), the message what to write instead. Also a ValueError."""

    def __init__(self, message: str, *, where: str) -> None:
        super().__init__(message, file=where)


class RedisRefusesWritesError(RedisWriteError):
    """Redis answered the writes with an error reply, as a rule one that is not about
    any key (MISCONF, READONLY, OOM, NOREPLICAS, NOPERM, BUSY, LOADING, ...): it refuses
    writes for now. ``code`` is the reply's first word ("UNKNOWN" when it has none),
    ``reply`` its whole text."""

    def __init__(self, code: str, reply: str) -> None:
        super().__init__(f"Redis refuses writes: {reply}")
        self.code = code
        self.reply = reply


class UnwrittenTouchesError(CoalescerError):
    """``close()`` could not write every accepted touch to Redis before its flush
    timeout: ``keys`` (sorted) and ``count`` are the keys left unwritten, whose touches
    are lost with this process. Everything else was closed and released."""

    def __init__(self, keys: Sequence[str], reason: str) -> None:
        self.keys = sorted(keys)
        self.count = len(self.keys)
        self.reason = reason
        shown = ", ".join(shown_key(key) for key in self.keys[:5])
        more = f" and {self.count - 5} more" if self.count > 5 else ""
        super().__init__(f"close(): {self.count} touched keys were not written to Redis "
                         f"({reason}): {shown}{more}")


class EvictionPolicyError(CoalescerError):
    """The Redis server's ``maxmemory-policy`` may evict coalescer's keys (pending
    touches, claims, leases would vanish without a trace): refused at start."""


class ProtocolVersionError(CoalescerError):
    """The namespace's keys were written under a touch protocol whose major version
    this coalescer does not speak (docs/protocol.md): refused at start."""

    def __init__(self, message: str, *, stored: str, spoken: str) -> None:
        super().__init__(message)
        self.stored = stored
        self.spoken = spoken


class ClosedError(CoalescerError):
    """touch() or flush() on a coalescer that is closed or not started."""


class SourceReadError(CoalescerError):
    """``drain()`` could not read one of the rules file's sources (its database, broker
    or stream cannot be reached, or did not answer in time); ``source`` is its name."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"drain(): {message}")
        self.source = source


class NotLeaderError(CoalescerError):
    """A claim was refused because this node no longer holds the shard's lease."""


class LayoutMovedError(CoalescerError):
    """A write used a shard layout older than the one the shard follows (a reshard
    began or ended): nothing was written; read the layout again and write once more."""

    def __init__(self, shard: int, marker: int) -> None:
        super().__init__(f"shard {shard} follows layout generation {marker}: a newer "
                         "one than the writer's")
        self.marker = marker


class ScriptError(CoalescerError):
    """A Lua script answered with a code that coalescer does not know."""


class WebhookError(CoalescerError):
    """A webhook call that failed: a non-2xx answer, a connection error, a missing secret."""


class ReplicationError(RedisWriteError):
    """A write reached the Redis primary, but fewer replicas than ``durability: replicas``
    acknowledged it within ``durability: timeout``: it is not counted as written (a
    flush keeps the touches buffered and writes them again; a node does not run such a
    claim). ``acknowledged`` replicas held it, ``wanted`` were asked for."""

    def __init__(self, acknowledged: int, wanted: int, timeout: float,
                 result: object = None) -> None:
        super().__init__(f"only {acknowledged} of {wanted} Redis replicas acknowledged the "
                         f"write within {timeout:g}s (durability: replicas: {wanted})")
        self.acknowledged = acknowledged
        self.wanted = wanted
        self.timeout = timeout
        self.result = result  # what the primary answered (the write did run there)
