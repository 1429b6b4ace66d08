"""Key patterns of rules: ``{name}`` captures one ':'-free segment, ``*`` matches anything."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

_TOKEN_RE = re.compile(r"\{[^{}]*\}|[{}]|\*+|[^{}*]+")
# No key may hold a NUL: it separates keys in the upsert script's argument, so
# neither a capture nor a wildcard matches one (such a key matches no rule).
_CAPTURE = "([^:\x00]+)"
_ANYTHING = "[^\x00]*"
ALLOWED = (
    "a pattern is literal text with {name} captures (one non-empty segment without ':', "
    "name an identifier, each name once) and * wildcards (anything, ':' included); "
    "no key may contain a NUL character"
)


@dataclass(frozen=True, slots=True)
class KeyPattern:
    """A compiled key pattern; the whole key must match."""

    source: str
    expression: str  # the regex, unnamed groups: config/rules.py joins those of every rule
    names: tuple[str, ...]
    named_expression: str  # the same, each capture a named group: groupdict() is the params

    @classmethod
    def compile(cls, source: str) -> KeyPattern:
        """Compile ``source``; ValueError says what is wrong and what is allowed."""
        if not isinstance(source, str) or not source:
            raise ValueError(f"empty pattern {source!r}: {ALLOWED}")
        parts: list[str] = []
        names: list[str] = []
        for token in _TOKEN_RE.findall(source):
            parts.append(_translate(token, names, source))
        named = iter(names)
        with_names = [f"(?P<{next(named)}>{part[1:]}" if part == _CAPTURE else part
                      for part in parts]
        return cls(source=source, expression="".join(parts), names=tuple(names),
                   named_expression="".join(with_names))

    @property
    def named(self) -> re.Pattern[str]:
        """The compiled regex with named groups, compiled on first use (a rules file of
        thousands of rules loads without compiling a regex a rule)."""
        return _compiled(self.named_expression)

    def match(self, key: str) -> dict[str, str] | None:
        """The captured segments when ``key`` matches the whole pattern, else None."""
        found = self.named.fullmatch(key)
        return None if found is None else found.groupdict()

    def __str__(self) -> str:
        return self.source


@cache
def _compiled(expression: str) -> re.Pattern[str]:
    return re.compile(expression, re.DOTALL)


def _translate(token: str, names: list[str], source: str) -> str:
    if token in ("{", "}"):
        raise ValueError(f"unbalanced {token!r} in pattern {source!r}: {ALLOWED}")
    if token.startswith("*"):
        return _ANYTHING
    if not token.startswith("{"):
        return re.escape(token)
    name = token[1:-1]
    if not name:
        raise ValueError(f"empty braces {{}} in pattern {source!r}: {ALLOWED}")
    if not name.isidentifier():
        raise ValueError(f"capture name {name!r} in pattern {source!r} is not an identifier: "
                         f"{ALLOWED}")
    if name in names:
        raise ValueError(f"capture name {name!r} appears twice in pattern {source!r}: "
                         f"{ALLOWED}")
    names.append(name)
    return _CAPTURE


# --- which keys a pattern matches, compared between patterns ---------------------------
#
# A pattern is a sequence of steps: a literal character, a capture (one or more characters
# other than ':'), or a wildcard (any characters). Whether every key one list of patterns
# matches is also matched by another is decided exactly on an alphabet of the literal
# characters, ':' and one stand-in for every other character (which no step tells apart).

_OTHER = ""  # the stand-in: equal to no character of a key
_MAX_STATES = 20_000  # past this many, give up and answer "not certainly covered"
Step = tuple[str, str]  # ("lit", c), ("char", "") a non-':' character, ("loop", ":"|"")


def _steps(pattern: KeyPattern) -> tuple[Step, ...]:
    steps: list[Step] = []
    for token in _TOKEN_RE.findall(pattern.source):
        if token.startswith("*"):
            steps.append(("loop", ""))
        elif token.startswith("{"):
            steps += [("char", ""), ("loop", ":")]
        else:
            steps += [("lit", c) for c in token]
    return tuple(steps)


def _accepts(step: Step, char: str) -> bool:
    kind, arg = step
    if kind == "lit":
        return char == arg
    return char != ":" or (kind == "loop" and arg == "")


def _closure(steps: tuple[Step, ...], at: int) -> set[int]:
    """``at`` and every later position reachable by skipping loops."""
    found = {at}
    while at < len(steps) and steps[at][0] == "loop":
        at += 1
        found.add(at)
    return found


State = frozenset[tuple[int, int]]  # (pattern number, position)


def _start(machines: list[tuple[Step, ...]]) -> State:
    return frozenset((m, p) for m, steps in enumerate(machines) for p in _closure(steps, 0))


def _advance(machines: list[tuple[Step, ...]], state: State, char: str) -> State:
    after: set[tuple[int, int]] = set()
    for m, position in state:
        steps = machines[m]
        if position == len(steps) or not _accepts(steps[position], char):
            continue
        following = position if steps[position][0] == "loop" else position + 1
        after |= {(m, p) for p in _closure(steps, following)}
    return frozenset(after)


def _accepting(machines: list[tuple[Step, ...]], state: State) -> bool:
    return any(position == len(machines[m]) for m, position in state)


def covers(earlier: list[KeyPattern], later: KeyPattern) -> bool:
    """True when every key ``later`` matches is matched by one of ``earlier`` (so a rule
    with ``later`` listed after them never matches). False when unsure."""
    firsts = [_steps(p) for p in earlier]
    mine = [_steps(later)]
    alphabet = {c for steps in [*firsts, *mine] for kind, c in steps if kind == "lit"}
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
