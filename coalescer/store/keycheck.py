"""Which touched keys Redis can store: checked once, on a key's first touch.

A key is sent to Redis as UTF-8, and the keys of one write travel joined by NUL
characters in one argument, so a key must encode as UTF-8 (no lone surrogates),
hold no NUL, and stay within ``MAX_KEY_BYTES``.

``unstorable_keys`` finds the keys of a request that Redis cannot store, and
``unstorable_message`` says why nothing was done, for the CLI and the HTTP API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from coalescer.common.plural import plural
from coalescer.errors import InvalidKeyError, shown_key

MAX_KEY_BYTES = 1024


def key_problem(key: object) -> str | None:
    """Why Redis cannot store ``key``, or None when it can."""
    if not isinstance(key, str):
        return f"a key must be a str, not {type(key).__name__}"
    if key.isascii():
        size = len(key)
    else:
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError as exc:
            return (f"character {key[exc.start]!r} at index {exc.start} cannot be encoded "
                    "as UTF-8 (a lone surrogate)")
    if "\0" in key:
        return f"it contains a NUL character (at index {key.index(chr(0))})"
    if size > MAX_KEY_BYTES:
        return f"it is {size} bytes long in UTF-8, over the limit of {MAX_KEY_BYTES}"
    return None


def check_key(key: str) -> None:
    """Raise InvalidKeyError naming ``key`` and what is wrong when Redis cannot store it."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(key, problem)


@dataclass(frozen=True, kw_only=True)
class Unstorable:
    """A key Redis cannot store, at ``index`` in the keys asked for."""

    index: int
    key: str
    problem: str


def unstorable_keys(keys: Sequence[str]) -> list[Unstorable]:
    """The keys of ``keys`` that Redis cannot store, in order, each with its problem."""
    return [Unstorable(index=index, key=key, problem=problem)
            for index, key in enumerate(keys) if (problem := key_problem(key)) is not None]


def unstorable_message(bad: Sequence[Unstorable], *, undone: str,
                       first: Literal["key", "index", "none"]) -> str:
    """Why nothing was ``undone`` ("touched", "retried"): the first bad key is named by
    the key itself, by its index in the request, or not at all."""
    if first == "key":
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return (f"key {shown_key(bad[0].key)} cannot be stored: {bad[0].problem}{more}; "
                f"nothing was {undone}")
    where = f" (keys[{bad[0].index}]: {bad[0].problem})" if first == "index" else ""
    return f"{plural(len(bad), 'key')} cannot be stored{where}; nothing was {undone}"
