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

from coalescer.common import key_limits
from coalescer.common.plural import plural
from coalescer.errors import InvalidItemError, InvalidKeyError, shown_key

MAX_KEY_BYTES = key_limits.MAX_KEY_BYTES
MAX_ITEM_BYTES = 256  # an item is short: a changed row's id, not the row


def _unstorable(text: object, what: str, limit: int) -> str | None:
    """Why Redis cannot store ``text`` (a key or an item), or None when it can."""
    if not isinstance(text, str):
        return f"{what} must be a str, not {type(text).__name__}"
    try:
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return (f"character {text[exc.start]!r} at index {exc.start} cannot be encoded "
                "as UTF-8 (a lone surrogate)")
    if "\0" in text:
        return f"it contains a NUL character (at index {text.index(chr(0))})"
    if size > limit:
        return f"it is {size} bytes long in UTF-8, over the limit of {limit}"
    return None


def key_problem(key: object) -> str | None:
    """Why Redis cannot store ``key``, or None when it can."""
    return _unstorable(key, "a key", MAX_KEY_BYTES)


def check_key(key: str) -> None:
    """Raise InvalidKeyError naming ``key`` and what is wrong when Redis cannot store it."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(key, problem)


def item_problem(item: object) -> str | None:
    """Why ``item`` cannot go with a touch, or None when it can: an item is a non-empty
    str of at most ``MAX_ITEM_BYTES`` in UTF-8, without NUL (items travel NUL-joined,
    and the empty string marks an overflow in Redis)."""
    if item == "":
        return "an item must not be empty"
    return _unstorable(item, "an item", MAX_ITEM_BYTES)


def check_item(key: str, item: object, rule_name: str, takes_items: bool) -> None:
    """Raise InvalidItemError when ``item`` cannot go with a touch of ``key`` (of rule
    ``rule_name``, which may or may not take items)."""
    problem = item_problem(item)
    if problem is None and not takes_items:
        problem = (f"its rule {rule_name!r} takes no items (give the rule "
                   "items: {max: N} to deliver them to its refreshes)")
    if problem is not None:
        raise InvalidItemError(key, item, problem)


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
