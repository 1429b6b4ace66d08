"""Every exception coalescer raises on purpose, in one place."""

from __future__ import annotations

from collections.abc import Sequence


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
    """A touched key that matches no rule."""

    def __str__(self) -> str:
        return f"no rule matches key {self.key!r}"


class InvalidKeyError(KeyRefusedError):
    """A touched key that Redis cannot store (not UTF-8, a NUL character, too long)."""

    def __init__(self, key: str, reason: str) -> None:
        self.reason = reason
        super().__init__(key)

    def __str__(self) -> str:
        return f"key {shown_key(self.key)} cannot be stored: {self.reason}"


def shown_key(key: object, limit: int = 80) -> str:
    """``repr(key)``, cut short for a very long key."""
    if isinstance(key, str) and len(key) > limit:
        return f"{key[:limit]!r}... ({len(key)} characters)"
    return repr(key)


class BackpressureError(CoalescerError):
    """The in-process buffer is full: the touch was not accepted (G8)."""


class ClosedError(CoalescerError):
    """touch() or flush() on a coalescer that is closed or not started."""


class NotLeaderError(CoalescerError):
    """A claim was refused because this node no longer holds the shard's lease."""


class ScriptError(CoalescerError):
    """A Lua script answered with a code that coalescer does not know."""


class WebhookError(CoalescerError):
    """A webhook call that failed: a non-2xx answer, a connection error, a missing secret."""
