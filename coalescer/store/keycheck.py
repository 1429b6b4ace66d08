"""Which touched keys Redis can store: checked once, on a key's first touch.

A key is sent to Redis as UTF-8, and the keys of one write travel joined by NUL
characters in one argument, so a key must encode as UTF-8 (no lone surrogates),
hold no NUL, and stay within ``MAX_KEY_BYTES``.
"""

from __future__ import annotations

from coalescer.errors import InvalidKeyError

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
