"""Matching a key against a pattern's tokens in time linear in the key's length.

A pattern is a sequence of tokens: literal text, a capture (one or more characters other
than ':' and NUL) and a wildcard (any characters but NUL). Matching fills, from the end
of the key backwards, one table per token: ``table[j][i]`` is 1 when the tokens from
``j`` on match the key from position ``i`` to its end. Each table is filled with a bounded
number of steps per position, so the work is O(len(key) x tokens) whatever the pattern
(a backtracking regular expression takes O(len(key) ** wildcards) on some keys). The
captures are then read forwards, each capture and wildcard taking the most characters
that still let the rest match: the same answer a greedy regular expression gives.

Most patterns need none of that: when no token is a wildcard and every capture ends the
pattern or is followed by literal text that starts with ':', a capture must take its whole
run of characters up to the next ':' (or the end), so a regular expression with possessive
captures (``[^:\0]++``, which never give characters back) finds the same answer in one
linear pass, in C. Such patterns are matched that way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LITERAL, CAPTURE, ANYTHING = "literal", "capture", "anything"
_NUL = "\x00"


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # LITERAL, CAPTURE or ANYTHING
    text: str = ""  # the literal text


@dataclass(slots=True)
class Work:
    """A tally of the matcher's steps (positions visited, occurrences and runs looked at)."""

    steps: int = 0


@dataclass(frozen=True, slots=True)
class Matcher:
    """The tokens of one pattern, and the literal text every match starts and ends with."""

    tokens: tuple[Token, ...]
    prefix: str = field(init=False)
    suffix: str = field(init=False)
    shortest: int = field(init=False)  # no shorter key matches
    # the one-pass expression (see the module's docstring), compiled at the first match:
    # a rules file of 10,000 rules loads without compiling 10,000 expressions
    _fast: re.Pattern[str] | None = field(init=False, default=None)
    _fast_known: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        first, last = self.tokens[:1], self.tokens[-1:]
        object.__setattr__(self, "prefix", _literal(first))
        object.__setattr__(self, "suffix", _literal(last) if len(self.tokens) > 1 else "")
        object.__setattr__(self, "shortest", sum(
            len(t.text) if t.kind == LITERAL else int(t.kind == CAPTURE) for t in self.tokens))

    def match(self, key: str, work: Work | None = None) -> tuple[str, ...] | None:
        """The captured texts, in pattern order, when the whole ``key`` matches, else None."""
        fast = self._fast if self._fast_known else self.fast
        if fast is not None and work is None:
            found = fast.fullmatch(key)
            return None if found is None else found.groups()
        if (len(key) < self.shortest or not key.startswith(self.prefix)
                or not key.endswith(self.suffix)):
            return None
        tally = work if work is not None else Work()
        tables = _tables(self.tokens, key, tally)
        if not tables[0][0]:
            return None
        return _captures(self.tokens, key, tables)

    @property
    def fast(self) -> re.Pattern[str] | None:
        """The one-pass expression of this pattern, or None when it has none."""
        if not self._fast_known:
            object.__setattr__(self, "_fast", _fast(self.tokens))
            object.__setattr__(self, "_fast_known", True)
        return self._fast


def _fast(tokens: tuple[Token, ...]) -> re.Pattern[str] | None:
    """The possessive regular expression of ``tokens``, when it gives the same answers
    (no wildcard; each capture last or followed by literal text starting with ':')."""
    parts: list[str] = []
    for number, token in enumerate(tokens):
        if token.kind == ANYTHING:
            return None
        if token.kind == LITERAL:
            parts.append(re.escape(token.text))
            continue
        after = tokens[number + 1] if number + 1 < len(tokens) else None
        if after is not None and not (after.kind == LITERAL and after.text.startswith(":")):
            return None
        parts.append("([^:\x00]++)")
    return re.compile("".join(parts))


def _literal(tokens: tuple[Token, ...]) -> str:
    return tokens[0].text if tokens and tokens[0].kind == LITERAL else ""


def _tables(tokens: tuple[Token, ...], key: str, work: Work) -> list[bytearray]:
    size = len(key) + 1
    after = bytearray(size)
    after[-1] = 1  # nothing left to match at the key's end
    tables = [after]
    for token in reversed(tokens):
        if token.kind == LITERAL:
            after = _literal_table(token.text, key, after, work)
        elif token.kind == CAPTURE:
            after = _run_table(key, after, work, ":" + _NUL, at_least_one=True)
        else:
            after = _run_table(key, after, work, _NUL, at_least_one=False)
        tables.append(after)
    tables.reverse()
    return tables


def _literal_table(text: str, key: str, after: bytearray, work: Work) -> bytearray:
    """Position i matches when ``text`` starts there and the rest matches after it."""
    table = bytearray(len(after))
    at = key.find(text)
    while at >= 0:
        work.steps += 1
        if after[at + len(text)]:
            table[at] = 1
        at = key.find(text, at + 1)
    return table


def _run_table(key: str, after: bytearray, work: Work, stops: str, *,
               at_least_one: bool) -> bytearray:
    """For a capture or wildcard: within each run of characters it may take (the key cut
    at ``stops``), every position up to the last at which the rest matches matches."""
    table = bytearray(len(after))
    start = 0
    for run in _split(key, stops):
        work.steps += 1
        end = start + len(run)  # the run is key[start:end], the stop (if any) at end
        first = start + 1 if at_least_one else start
        last = after.rfind(1, first, end + 1)
        if last >= 0:
            upto = last if at_least_one else last + 1
            table[start:upto] = b"\x01" * (upto - start)
        start = end + 1
    return table


def _split(key: str, stops: str) -> list[str]:
    if len(stops) == 1:
        return key.split(stops)
    return key.replace(stops[1], stops[0]).split(stops[0])


def _stop(key: str, stops: str, at: int) -> int:
    """Where the run of characters from ``at`` that contains none of ``stops`` ends."""
    found = [position for position in (key.find(c, at) for c in stops) if position >= 0]
    return min(found, default=len(key))


def _captures(tokens: tuple[Token, ...], key: str, tables: list[bytearray]) -> tuple[str, ...]:
    found: list[str] = []
    at = 0
    for number, token in enumerate(tokens):
        if token.kind == LITERAL:
            at += len(token.text)
            continue
        run_end = _stop(key, ":" + _NUL if token.kind == CAPTURE else _NUL, at)
        first = at + 1 if token.kind == CAPTURE else at
        end = tables[number + 1].rfind(1, first, run_end + 1)
        if token.kind == CAPTURE:
            found.append(key[at:end])
        at = end
    return tuple(found)
