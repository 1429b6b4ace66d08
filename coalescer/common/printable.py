"""Text safe to print to a terminal or a log: control characters shown escaped.

C0 controls (newline and tab included), DEL, C1 controls, the line and paragraph
separators U+2028/U+2029 and the bidirectional overrides and isolates (U+202A-U+202E,
U+2066-U+2069) are written ``\\x1b``, ``\\u2028`` style, and a backslash is doubled, so
the escaped text is unambiguous and no key or error can move the cursor, clear the
screen, set the clipboard, start a forged log line or reorder what is shown.
"""

from __future__ import annotations

import re
from typing import Any

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\\\\]")


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every character that could forge output escaped (see the module)."""
    if text.isprintable() and "\\" not in text:  # the common case: nothing to do
        return text
    return _UNSAFE.sub(_escape, text)


def printable_values(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string, keys of
    mappings included, passed through ``printable``: what a text formatter shows."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_values(k): printable_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_values(v) for v in value]
    return value
