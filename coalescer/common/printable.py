"""Text safe to print to a terminal or a log: control and invisible characters shown
escaped (``\x1b``, ``\u200f``, ``\U000e0001`` style; which characters, and why:
docs/cli.md, "What a node logs about refreshes"): every character Python does not count
as printable, spaces other than the plain space included. A backslash is doubled, so
the escaped text is unambiguous: no key or error can forge a log line or make two
different keys look the same.
"""

from __future__ import annotations

from typing import Any


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str, *, backslashes: bool = True) -> str:
    """``text`` with every character that could forge output escaped (see the module).
    ``backslashes=False`` leaves backslashes as they are: for text that was escaped
    once already (a log formatter's last pass), so that it is not escaped twice."""
    if text.isprintable() and ("\\" not in text or not backslashes):
        return text  # the common case: nothing to do
    return "".join(
        "\\\\" if char == "\\" and backslashes
        else char if char.isprintable() or char == "\\" else _escaped(char)
        for char in text)


def unsafe_exception(exc: BaseException) -> bool:
    """Whether a message anywhere in ``exc``'s traceback (the exception, its causes and
    contexts, an exception group's members, their notes) holds a character ``printable``
    escapes: such a traceback cannot be shown as it is, one line per line."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        texts = [_message(current), *map(str, getattr(current, "__notes__", None) or ())]
        if not all(text.isprintable() for text in texts):
            return True
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
        if isinstance(current, BaseExceptionGroup):
            todo += list(current.exceptions)
    return False


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__: the traceback prints a placeholder for it
        return ""


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
