"""JSON read with a bound on its nesting, in time linear in its length.

``json.loads`` recurses once per level of nesting: a value of a few kilobytes of ``[``
raises RecursionError, which is no ValueError, and a value just under the interpreter's
limit costs a deep stack. ``loads_bounded`` refuses a text nested deeper than ``MAX_DEPTH``
levels before decoding it (``TooDeep``, a ValueError naming the depth and where it is
passed). The check is cheap: a text with at most ``MAX_DEPTH`` opening brackets in all
is decoded at once; another has its strings blanked (a bracket inside a string does not
nest) by one pattern whose repeats cannot share characters, then its brackets counted in
one pass that stops at the first level too deep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

MAX_DEPTH = 32  # levels of arrays and objects a JSON value may nest

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")
_BRACKET_BYTES = re.compile(rb"[\[\]{}]")
_OPENS = (ord("["), ord("{"), "[", "{")


class TooDeep(ValueError):
    """A JSON text nested deeper than the bound."""


def depth_passed(text: str | bytes, limit: int = MAX_DEPTH) -> int | None:
    """Where (an offset in ``text``) its nesting first goes past ``limit`` levels, or
    None when it never does. Linear in ``len(text)``; strings are not counted."""
    brackets: Iterator[re.Match[str]] | Iterator[re.Match[bytes]]
    if isinstance(text, bytes):
        if text.count(b"[") + text.count(b"{") <= limit:
            return None
        brackets = _BRACKET_BYTES.finditer(_STRING_BYTES.sub(_blank_bytes, text))
    else:
        if text.count("[") + text.count("{") <= limit:
            return None
        brackets = _BRACKET.finditer(_STRING.sub(_blank, text))
    depth = 0
    for match in brackets:
        depth += 1 if match.group()[0] in _OPENS else -1
        if depth > limit:
            return match.start()
    return None


def _blank(match: re.Match[str]) -> str:
    return " " * len(match.group())  # same length: offsets stay those of the text


def _blank_bytes(match: re.Match[bytes]) -> bytes:
    return b" " * len(match.group())


def loads_bounded(text: str | bytes, limit: int = MAX_DEPTH, **options: Any) -> Any:
    """``json.loads(text, **options)``; TooDeep when ``text`` nests deeper than
    ``limit`` levels (checked first), ValueError when it is not JSON."""
    where = depth_passed(text, limit)
    if where is not None:
        raise TooDeep(f"more than {limit} levels deep (at offset {where})")
    try:
        return json.loads(text, **options)
    except RecursionError:  # not reached with a limit below the interpreter's
        raise TooDeep(f"more than {limit} levels deep") from None
