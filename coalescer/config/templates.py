"""Key templates of stream sources: ``{field}`` is filled from a stream entry's field.

A template is literal text with ``{field}`` placeholders (a field name: anything
but braces, not empty). ``could_match`` decides, at load time, whether some
filling of a template could match a rule's key pattern at all: both are turned
into sequences of atoms (one character of a set, or any number of them) and the
two automata are walked in step.

Filling a template is linear and bounded: the length of the text it would make is summed
first, and a text longer than ``MAX_FILLED`` characters (the longest key Redis may store;
an item or a time is shorter still) is refused (``TemplateOverflow``, naming the longest
field) before it is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coalescer.common.key_limits import MAX_KEY_BYTES
from coalescer.config.patterns import KeyPattern

_TOKEN_RE = re.compile(r"\{[^{}]*\}|[{}]|[^{}]+")
_PATTERN_TOKEN_RE = re.compile(r"\{[^{}]*\}|\*+|[^{}*]+")
MAX_FILLED = MAX_KEY_BYTES  # characters a filled template may have at most
ALLOWED = "a key template is literal text with {field} placeholders, each naming a field"

# A character set is a literal character, or one of these classes (NUL never matches:
# no key may hold one).
_ANY = "any"  # any character but NUL
_SEGMENT = "segment"  # any character but NUL and ':'


class TemplateOverflow(ValueError):
    """A template whose fields would fill it past ``MAX_FILLED`` characters."""


@dataclass(frozen=True, slots=True)
class _Atom:
    chars: str  # one literal character, or _ANY / _SEGMENT
    repeat: bool  # True: zero or more; False: exactly one

    @property
    def literal(self) -> bool:
        return self.chars not in (_ANY, _SEGMENT)


def _overlap(a: str, b: str) -> bool:
    """Whether two character sets share a character."""
    if a in (_ANY, _SEGMENT) and b in (_ANY, _SEGMENT):
        return True
    if a in (_ANY, _SEGMENT):
        a, b = b, a
    if b == _ANY:
        return a != "\0"
    if b == _SEGMENT:
        return a not in ("\0", ":")
    return a == b


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A compiled key template."""

    source: str
    parts: tuple[tuple[str, bool], ...]  # (text, is_field) in order
    fields: tuple[str, ...]  # the field names, each once, in order of first use

    @classmethod
    def compile(cls, source: str) -> KeyTemplate:
        """Compile ``source``; ValueError says what is wrong."""
        parts: list[tuple[str, bool]] = []
        for token in _TOKEN_RE.findall(source):
            if token in ("{", "}"):
                raise ValueError(f"unbalanced {token!r} in key template {source!r}: {ALLOWED}")
            if token.startswith("{"):
                if token == "{}":
                    raise ValueError(f"empty braces {{}} in key template {source!r}: {ALLOWED}")
                parts.append((token[1:-1], True))
            else:
                parts.append((token, False))
        fields = tuple(dict.fromkeys(text for text, is_field in parts if is_field))
        return cls(source=source, parts=tuple(parts), fields=fields)

    def fill(self, values: dict[str, str]) -> str:
        """The key with every placeholder replaced; KeyError names a missing field,
        TemplateOverflow a text that would be longer than MAX_FILLED (checked first)."""
        size = sum(len(values[text]) if is_field else len(text) for text, is_field in self.parts)
        if size > MAX_FILLED:
            raise TemplateOverflow(f"template {shown(self.source)} would make {size} "
                                   f"characters, over the limit of {MAX_FILLED}"
                                   f"{_longest(self.fields, values)}")
        return "".join(values[text] if is_field else text for text, is_field in self.parts)

    def could_match(self, pattern: KeyPattern) -> bool:
        """Whether some field values would make a key that ``pattern`` matches."""
        return _intersects(self._atoms(), _pattern_atoms(pattern.source))

    def _atoms(self) -> list[_Atom]:
        atoms: list[_Atom] = []
        for text, is_field in self.parts:
            if is_field:
                atoms.append(_Atom(_ANY, True))
            else:
                atoms += [_Atom(char, False) for char in text]
        return atoms

    def __str__(self) -> str:
        return self.source


def _longest(fields: tuple[str, ...], values: dict[str, str]) -> str:
    """Which field holds the most characters, said for an error (none: "")."""
    if not fields:
        return ""
    name = max(fields, key=lambda field: len(values[field]))
    return f" (field {shown(name)} holds {len(values[name])})"


def shown(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut short for a long one."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}..."


def _pattern_atoms(source: str) -> list[_Atom]:
    atoms: list[_Atom] = []
    for token in _PATTERN_TOKEN_RE.findall(source):
        if token.startswith("*"):
            atoms.append(_Atom(_ANY, True))
        elif token.startswith("{"):
            atoms += [_Atom(_SEGMENT, False), _Atom(_SEGMENT, True)]
        else:
            atoms += [_Atom(char, False) for char in token]
    return atoms


def _closure(atoms: list[_Atom], i: int) -> list[int]:
    """Positions reachable from ``i`` by skipping repeated atoms (matching nothing)."""
    out = [i]
    while i < len(atoms) and atoms[i].repeat:
        i += 1
        out.append(i)
    return out


def _steps(atoms: list[_Atom], i: int) -> list[int]:
    """Where atom ``i`` goes after consuming one character."""
    return [i] if atoms[i].repeat else [i + 1]


def _intersects(a: list[_Atom], b: list[_Atom]) -> bool:
    """Whether some string is matched by both atom sequences."""
    seen: set[tuple[int, int]] = set()
    todo = [(i, j) for i in _closure(a, 0) for j in _closure(b, 0)]
    while todo:
        i, j = todo.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(a) and j == len(b):
            return True
        if i == len(a) or j == len(b) or not _overlap(a[i].chars, b[j].chars):
            continue
        todo += [(x, y) for ni in _steps(a, i) for nj in _steps(b, j)
                 for x in _closure(a, ni) for y in _closure(b, nj)]
    return False
