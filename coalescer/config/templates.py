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
from coalescer.config.patterns import ANY, Atom, KeyPattern, after, atoms, closure, overlap

_TOKEN_RE = re.compile(r"\{[^{}]*\}|[{}]|[^{}]+")
MAX_FILLED = MAX_KEY_BYTES  # characters a filled template may have at most
ALLOWED = "a key template is literal text with {field} placeholders, each naming a field"


class TemplateOverflow(ValueError):
    """A template whose fields would fill it past ``MAX_FILLED`` characters."""


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
        return _intersects(self._atoms(), atoms(pattern))

    def _atoms(self) -> list[Atom]:
        atoms: list[Atom] = []
        for text, is_field in self.parts:
            if is_field:
                atoms.append(Atom(ANY, True))
            else:
                atoms += [Atom(char, False) for char in text]
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


def _intersects(a: list[Atom], b: list[Atom]) -> bool:
    """Whether some string is matched by both atom sequences."""
    seen: set[tuple[int, int]] = set()
    todo = [(i, j) for i in closure(a, 0) for j in closure(b, 0)]
    while todo:
        i, j = todo.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(a) and j == len(b):
            return True
        if i == len(a) or j == len(b) or not overlap(a[i].chars, b[j].chars):
            continue
        todo += [(x, y) for x in closure(a, after(a, i)) for y in closure(b, after(b, j))]
    return False
