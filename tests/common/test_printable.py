from __future__ import annotations

import pytest

from coalescer.common.printable import printable


@pytest.mark.parametrize(("raw", "shown"), [
    ("boom:\x1b[2J\x1b[H", "boom:\\x1b[2J\\x1b[H"),
    ("any:\x1b]52;c;aGk=\x07", "any:\\x1b]52;c;aGk=\\x07"),
    ("any:line1\nFAKE LOG LINE", "any:line1\\nFAKE LOG LINE".replace("\\n", "\\x0a")),
    ("tab\there\r", "tab\\x09here\\x0d"),
    ("del\x7f c1\x9b", "del\\x7f c1\\x9b"),
    ("sep\u2028\u2029", "sep\\u2028\\u2029"),
    ("bidi\u202eevil\u2066", "bidi\\u202eevil\\u2066"),
    ("a\\x1b", "a\\\\x1b"),  # a literal backslash cannot pass for an escape
])
def test_control_characters_are_shown_escaped(raw: str, shown: str) -> None:
    assert printable(raw) == shown


@pytest.mark.parametrize("text", ["orders:42", "", "naïve:日本:ü", "spaces are fine"])
def test_printable_text_is_unchanged(text: str) -> None:
    assert printable(text) == text


def test_a_log_line_with_a_forged_key_stays_one_line() -> None:
    import logging

    from coalescer.cli.main import LOG_FORMAT, RedactingFormatter

    record = logging.LogRecord("coalescer.worker", logging.WARNING, __file__, 1,
                               "refresh of %s failed: %s", ("any:line1\nFAKE LOG LINE",
                                                            "boom\x1b[2J"), None)
    line = RedactingFormatter(LOG_FORMAT).format(record)
    assert "\n" not in line and "\x1b" not in line
    assert "any:line1\\x0aFAKE LOG LINE" in line and "boom\\x1b[2J" in line
