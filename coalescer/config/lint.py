"""Warnings about a rules file that loads: rules that can never match, and webhook
secrets that are not set where the file is checked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coalescer.config.patterns import KeyPattern, covers


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
    wins) match every key it would. Only certain cases are reported."""
    found: list[ConfigWarning] = []
    for position, rule in enumerate(matches):
        earlier = matches[:position]
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
