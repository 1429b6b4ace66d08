"""Key patterns of rules: ``{name}`` captures one ':'-free segment, ``*`` matches anything."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from coalescer.config.matcher import ANYTHING, CAPTURE, LITERAL, Matcher, Token, Work

_TOKEN_RE = re.compile(r"\{[^{}]*\}|[{}]|\*+|[^{}*]+")
# No key may hold a NUL: it separates keys in the upsert script's argument, so neither a
# capture nor a wildcard matches one (such a key matches no rule).
ALLOWED = (
    "a pattern is literal text with {name} captures (one non-empty segment without ':', "
    "name an identifier, each name once) and * wildcards (anything, ':' included); "
    "no key may contain a NUL character"
)


@dataclass(frozen=True, slots=True)
class KeyPattern:
    """A compiled key pattern; the whole key must match. Matching takes time linear in the
    key's length, whatever the pattern (coalescer.config.matcher)."""

    source: str
    names: tuple[str, ...]
    matcher: Matcher = field(repr=False, compare=False)

    @classmethod
    def compile(cls, source: str) -> KeyPattern:
        """Compile ``source``; ValueError says what is wrong and what is allowed."""
        if not isinstance(source, str) or not source:
            raise ValueError(f"empty pattern {source!r}: {ALLOWED}")
        tokens: list[Token] = []
        names: list[str] = []
        for text in _TOKEN_RE.findall(source):
            tokens.append(_token(text, names, source))
        return cls(source=source, names=tuple(names), matcher=Matcher(tuple(tokens)))

    @property
    def prefix(self) -> str:
        """The literal text every key this pattern matches starts with."""
        return self.matcher.prefix

    def match(self, key: str, work: Work | None = None) -> dict[str, str] | None:
        """The captured segments when ``key`` matches the whole pattern, else None
        (``work``, when given, tallies the matcher's steps)."""
        found = self.matcher.match(key, work)
        return None if found is None else dict(zip(self.names, found, strict=True))

    def __str__(self) -> str:
        return self.source


def _token(text: str, names: list[str], source: str) -> Token:
    if text in ("{", "}"):
        raise ValueError(f"unbalanced {text!r} in pattern {source!r}: {ALLOWED}")
    if text.startswith("*"):
        return Token(ANYTHING)
    if not text.startswith("{"):
        return Token(LITERAL, text)
    name = text[1:-1]
    if not name:
        raise ValueError(f"empty braces {{}} in pattern {source!r}: {ALLOWED}")
    if not name.isidentifier():
        raise ValueError(f"capture name {name!r} in pattern {source!r} is not an identifier: "
                         f"{ALLOWED}")
    if name in names:
        raise ValueError(f"capture name {name!r} appears twice in pattern {source!r}: "
                         f"{ALLOWED}")
    names.append(name)
    return Token(CAPTURE)


# --- which keys a pattern matches, compared between patterns (and key templates) ---------
#
# A pattern is a sequence of atoms, each one character of a set (a literal character, any
# character but ':' or any character at all), once or repeated (zero or more): a capture
# is one non-':' character then any more. Whether every key one list of patterns matches
# is also matched by another is decided exactly on an alphabet of the literal characters,
# ':' and one stand-in for every other character (which no atom tells apart).

ANY = "any"  # any character but NUL
SEGMENT = "segment"  # any character but NUL and ':'
_OTHER = ""  # the stand-in: equal to no character of a key
_MAX_STATES = 20_000  # past this many, give up and answer "not certainly covered"


@dataclass(frozen=True, slots=True)
class Atom:
    chars: str  # one literal character, or ANY / SEGMENT
    repeat: bool  # True: zero or more; False: exactly one


def overlap(a: str, b: str) -> bool:
    """Whether two character sets (or a set and a character) share a character."""
    if a in (ANY, SEGMENT) and b in (ANY, SEGMENT):
        return True
    if a in (ANY, SEGMENT):
        a, b = b, a
    if b == ANY:
        return a != "\0"
    if b == SEGMENT:
        return a not in ("\0", ":")
    return a == b


def atoms(pattern: KeyPattern) -> list[Atom]:
    found: list[Atom] = []
    for token in _TOKEN_RE.findall(pattern.source):
        if token.startswith("*"):
            found.append(Atom(ANY, True))
        elif token.startswith("{"):
            found += [Atom(SEGMENT, False), Atom(SEGMENT, True)]
        else:
            found += [Atom(char, False) for char in token]
    return found


def closure(line: list[Atom], at: int) -> list[int]:
    """``at`` and every later position reachable by skipping repeated atoms."""
    found = [at]
    while at < len(line) and line[at].repeat:
        at += 1
        found.append(at)
    return found


def after(line: list[Atom], at: int) -> int:
    """Where atom ``at`` goes after consuming one character."""
    return at if line[at].repeat else at + 1


State = frozenset[tuple[int, int]]  # (pattern number, position)


def _start(machines: list[list[Atom]]) -> State:
    return frozenset((m, p) for m, line in enumerate(machines) for p in closure(line, 0))


def _advance(machines: list[list[Atom]], state: State, char: str) -> State:
    found: set[tuple[int, int]] = set()
    for m, position in state:
        line = machines[m]
        if position < len(line) and overlap(line[position].chars, char):
            found |= {(m, p) for p in closure(line, after(line, position))}
    return frozenset(found)


def _accepting(machines: list[list[Atom]], state: State) -> bool:
    return any(position == len(machines[m]) for m, position in state)


def covers(earlier: list[KeyPattern], later: KeyPattern) -> bool:
    """True when every key ``later`` matches is matched by one of ``earlier`` (so a rule
    with ``later`` listed after them never matches). False when unsure."""
    firsts = [atoms(p) for p in earlier]
    mine = [atoms(later)]
    alphabet = {a.chars for line in [*firsts, *mine] for a in line
                if a.chars not in (ANY, SEGMENT)}
    alphabet |= {":", _OTHER}
    todo = [(_start(mine), _start(firsts))]
    seen = set(todo)
    while todo:
        own, theirs = todo.pop()
        if _accepting(mine, own) and not _accepting(firsts, theirs):
            return False
        for char in alphabet:
            pair = (_advance(mine, own, char), _advance(firsts, theirs, char))
            if pair[0] and pair not in seen:
                if len(seen) >= _MAX_STATES:
                    return False
                seen.add(pair)
                todo.append(pair)
    return True
