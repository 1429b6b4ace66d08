from __future__ import annotations

import pytest

from coalescer.common.printable import printable, unsafe_exception


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


@pytest.mark.parametrize(("raw", "shown"), [
    ("user:\u200f42", "user:\\u200f42"),  # a right-to-left mark: looks like user:42
    ("\ufeffuser:42", "\\ufeffuser:42"),  # a byte order mark: invisible
    ("zero\u200bwidth\u2060joiner", "zero\\u200bwidth\\u2060joiner"),
    ("tag\U000e0041", "tag\\U000e0041"),  # a tag character (format, outside the BMP)
    ("nbsp\u00a0", "nbsp\\xa0"),
])
def test_invisible_characters_are_shown_escaped(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    looks_alike = "".join(char for char in raw if char.isprintable())
    assert printable(raw) != printable(looks_alike)  # two keys never look the same


def test_the_node_log_escapes_a_key_once() -> None:
    import logging

    from coalescer.cli.main import LOG_FORMAT, RedactingFormatter

    # the runner escapes the key it logs; the node's formatter must not escape it again
    record = logging.LogRecord("coalescer.worker.runner", logging.WARNING, __file__, 1,
                               "refresh of %s failed", (printable("a\rb\u200f"),), None)
    line = RedactingFormatter(LOG_FORMAT).format(record)
    assert line.endswith("refresh of a\\x0db\\u200f failed")
    raw = logging.LogRecord("other", logging.WARNING, __file__, 1, "%s", ("x\ry",), None)
    assert RedactingFormatter(LOG_FORMAT).format(raw).endswith("x\\x0dy")


def _failing(message: str) -> BaseException:
    try:
        try:
            raise ValueError(message)
        except ValueError as inner:
            raise RuntimeError("outer, harmless") from inner
    except RuntimeError as exc:
        return exc


def test_a_traceback_whose_cause_could_forge_a_line_is_one_escaped_line() -> None:
    import logging

    from coalescer.cli.main import LOG_FORMAT, RedactingFormatter

    forged = "x" * 250 + "\n2026-01-01 00:00:00,000 CRITICAL coalescer: forged"
    exc = _failing(forged)
    assert unsafe_exception(exc) and not unsafe_exception(_failing("plain"))
    record = logging.LogRecord("aiohttp", logging.ERROR, __file__, 1, "oops", (),
                               (type(exc), exc, exc.__traceback__))
    text = RedactingFormatter(LOG_FORMAT).format(record)
    assert not any(line.startswith("2026-01-01") for line in text.splitlines())
    assert "\\x0a2026-01-01 00:00:00,000 CRITICAL" in text
