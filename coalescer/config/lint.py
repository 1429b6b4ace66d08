"""Warnings about a rules file that loads: rules that can never match, and webhook
secrets that are not set where the file is checked."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coalescer.config.patterns import KeyPattern, covers

_TOKENS = re.compile(r"\{[^{}]*\}|\*+|[^{}*]+")  # a compiled pattern's literals, captures, *


@dataclass(frozen=True, slots=True)
class ConfigWarning:
    """Something in a rules file that works, but surely not as meant."""

    message: str
    file: str
    line: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        what = f"{self.field}: " if self.field else ""
        return f"{where}: {what}warning: {self.message}"


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """A rule's pattern and where the file gives it."""

    index: int
    name: str
    pattern: KeyPattern
    line: int

    def __str__(self) -> str:
        return f"rules[{self.index}] {self.name!r} ({self.pattern.source!r}, line {self.line})"


@dataclass(frozen=True, slots=True)
class RuleSecret:
    """A webhook rule's ``secret_env`` and where the file gives it."""

    index: int
    name: str
    env: str
    line: int

    @property
    def field(self) -> str:
        return f"rules[{self.index}].handler.http.secret_env"


def unreachable(file: str, matches: Sequence[RuleMatch]) -> list[ConfigWarning]:
    """A warning for each rule that can never match: the rules before it (first match
    wins) match every key it would. Only certain cases are reported.

    Only earlier rules that could share a key with a rule are compared with it (see
    :class:`_Index`), so a file of many rules is checked in near-linear time."""
    found: list[ConfigWarning] = []
    index = _Index()
    for rule in matches:
        earlier = index.candidates(rule)
        index.add(rule)
        culprit = next((e for e in earlier if covers([e.pattern], rule.pattern)), None)
        if culprit is not None:
            by = f"{culprit}, listed before it"
        elif len(earlier) > 1 and covers([e.pattern for e in earlier], rule.pattern):
            by = "the rules listed before it, between them"
        else:
            continue
        found.append(ConfigWarning(
            f"rule {rule.name!r} can never match: every key its pattern "
            f"{rule.pattern.source!r} matches is matched first by {by} (the first match "
            "wins); move it up or remove it", file, rule.line, f"rules[{rule.index}].match"))
    return found


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a pattern's keys surely share: literal text before the first capture or
    wildcard, literal text after the last, and how many ':' (exactly, without ``*``)."""

    prefix: str
    suffix: str
    colons: int
    exact: bool

    @classmethod
    def of(cls, pattern: KeyPattern) -> _Shape:
        tokens = _TOKENS.findall(pattern.source)
        literal = [not t.startswith(("{", "*")) for t in tokens]
        prefix = tokens[0] if literal[0] else ""
        suffix = tokens[-1] if literal[-1] and len(tokens) > 1 else ""
        if len(tokens) == 1 and literal[0]:
            suffix = prefix
        colons = sum(t.count(":") for t, lit in zip(tokens, literal, strict=True) if lit)
        return cls(prefix, suffix, colons, exact="*" not in pattern.source)

    def may_share_a_key(self, other: _Shape) -> bool:
        """False only when no key can match both patterns."""
        if not (self.prefix.startswith(other.prefix) or other.prefix.startswith(self.prefix)):
            return False
        if not (self.suffix.endswith(other.suffix) or other.suffix.endswith(self.suffix)):
            return False
        if self.exact and other.exact:
            return self.colons == other.colons
        if self.exact:
            return self.colons >= other.colons
        return not other.exact or other.colons >= self.colons


class _Index:
    """The rules seen so far, by literal prefix in a trie: the rules that may share a key
    with a new one have a prefix that is a prefix of its own or extends it. A pattern with
    no key in common with a rule changes neither whether one earlier rule covers it nor
    whether all of them do, so leaving such patterns out keeps the warnings as they are."""

    def __init__(self) -> None:
        self._root: _Node = _Node()
        self._count = 0

    def add(self, rule: RuleMatch) -> None:
        shape = _Shape.of(rule.pattern)
        node = self._root
        for char in shape.prefix:
            node = node.children.setdefault(char, _Node())
        node.here.append((self._count, rule, shape))
        self._count += 1

    def candidates(self, rule: RuleMatch) -> list[RuleMatch]:
        """The earlier rules that may share a key with ``rule``, in file order."""
        shape = _Shape.of(rule.pattern)
        found: list[tuple[int, RuleMatch, _Shape]] = []
        node: _Node | None = self._root
        for char in shape.prefix:
            assert node is not None
            found += node.here
            node = node.children.get(char)
            if node is None:
                break
        if node is not None:
            found += node.subtree()
        found.sort(key=lambda entry: entry[0])
        return [other for _, other, seen in found if shape.may_share_a_key(seen)]


class _Node:
    __slots__ = ("children", "here")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.here: list[tuple[int, RuleMatch, _Shape]] = []

    def subtree(self) -> list[tuple[int, RuleMatch, _Shape]]:
        found: list[tuple[int, RuleMatch, _Shape]] = []
        todo = [self]
        while todo:
            node = todo.pop()
            found += node.here
            todo += node.children.values()
        return found


def unset(secrets: Sequence[RuleSecret], environ: Mapping[str, str]) -> list[RuleSecret]:
    """The secrets whose environment variable is not set, or empty, in ``environ``."""
    return [secret for secret in secrets if not environ.get(secret.env)]


def unset_secret_warnings(file: str, secrets: Sequence[RuleSecret],
                          environ: Mapping[str, str]) -> list[ConfigWarning]:
    """A warning for each webhook secret not set here (a worker node refuses to start)."""
    return [ConfigWarning(
        f"environment variable {secret.env} is not set (or empty) here; rule "
        f"{secret.name!r} signs its webhook with it, so `coalescer run` refuses to start "
        "without it", file, secret.line, secret.field) for secret in unset(secrets, environ)]
