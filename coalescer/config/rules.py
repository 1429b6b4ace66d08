"""The rules file's model: ``Config`` (the whole file: settings, rules in match order,
sources), loading it (``Config.from_yaml``, ``check_file``) and matching keys to rules
(``Config.rule_for``). ``coalescer.config.model`` holds one ``Rule``;
``coalescer.config.schema`` reads the YAML; ``coalescer.config.yaml_reader`` reads files."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from coalescer.common.key_limits import over_limit
from coalescer.config.durability import NO_REPLICAS, Durability
from coalescer.config.durations import format_duration
from coalescer.config.handler_import import HandlerImport, resolve
from coalescer.config.limits import DEFAULT_LIMITS, Limits
from coalescer.config.lint import (
    ConfigWarning,
    RuleMatch,
    RuleSecret,
    unreachable,
    unset,
    unset_secret_warnings,
)
from coalescer.config.model import Handler, HttpHandler, RetryPolicy, Rule
from coalescer.config.namespace_env import namespace_override
from coalescer.config.rule_index import RuleIndex
from coalescer.config.schema import DEFAULT_HISTORY, Document, RulesSchema
from coalescer.config.sources import SourceConfig, unset_env_warnings
from coalescer.config.yaml_reader import NAME_RE, read_text
from coalescer.errors import ConfigError, InvalidKeyError, UnknownKeyError

__all__ = [
    "NAME_RE", "CheckReport", "Config", "Handler", "HttpHandler", "RetryPolicy", "Rule",
    "check_config", "check_file",
]

_CAPTURE_RE = re.compile(r"\{[^{}]*\}|\*")  # left out of a pattern compared with a key


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A loaded rules file. Rules match in file order; the first match wins."""

    namespace: str
    shards: int
    leader_lease: float
    claim_lease: float
    rules: tuple[Rule, ...]
    source: str
    history: int = DEFAULT_HISTORY
    sources: tuple[SourceConfig, ...] = ()
    durability: Durability = NO_REPLICAS
    limits: Limits = DEFAULT_LIMITS
    built_in: str | None = None  # the Python file whose Rules(...) built these; None: a file
    matches: tuple[RuleMatch, ...] = field(default=(), repr=False, compare=False)
    secrets: tuple[RuleSecret, ...] = field(default=(), repr=False, compare=False)
    _by_name: dict[str, Rule] = field(init=False, repr=False, compare=False)
    _index: RuleIndex = field(init=False, repr=False, compare=False)
    _near: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {rule.name: rule for rule in self.rules})
        object.__setattr__(self, "_index", RuleIndex([rule.pattern for rule in self.rules]))
        object.__setattr__(self, "_near", tuple(
            (_CAPTURE_RE.sub("", rule.pattern.source),
             f"{rule.pattern.source!r} of rule {rule.name}") for rule in self.rules))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, import_handlers: bool = True) -> Config:
        """Load and validate a rules file; handlers import from the file's folder.

        With ``import_handlers=False`` (a process that only touches keys) no handler
        module is imported: each Python handler stays a ``HandlerImport`` until
        ``with_handlers()``. Raises one ConfigError carrying every problem found.
        """
        source = os.fspath(path)
        text = read_text(source)
        return cls.from_string(text, source=source, base_dir=Path(source).resolve().parent,
                               import_handlers=import_handlers)

    @classmethod
    def from_string(cls, text: str, *, source: str = "<string>", base_dir: Path | None = None,
                    import_handlers: bool = True) -> Config:
        """Load and validate rules from text; handlers import from ``base_dir`` if given."""
        schema = RulesSchema(source, base_dir, import_handlers)
        config = _config(schema, schema.load(text))
        problems = schema.outcome()
        if problems is not None or config is None:
            raise problems or ConfigError("cannot be loaded", file=source)
        return config

    def with_handlers(self) -> Config:
        """This config with every Python handler imported and checked (what a worker
        needs); one ConfigError with the file, line and field of each that fails."""
        if not any(isinstance(rule.handler, HandlerImport) for rule in self.rules):
            return self
        errors: list[ConfigError] = []
        rules: list[Rule] = []
        for rule in self.rules:
            if isinstance(rule.handler, HandlerImport):
                try:
                    rule = replace(rule, handler=resolve(rule.handler))  # noqa: PLW2901
                    _check_isolation(rule)
                except ConfigError as exc:
                    errors.append(exc)
            rules.append(rule)
        if errors:
            raise ConfigError.combine(errors)
        return replace(self, rules=tuple(rules))

    def unset_secrets(self, environ: Mapping[str, str]) -> list[ConfigError]:
        """An error for each webhook ``secret_env`` not set (or empty) in ``environ``:
        a worker refuses to start, since every refresh of that rule would fail."""
        return [ConfigError(
            f"rule {secret.name!r} signs its webhook with the environment variable "
            f"{secret.env}, which is not set (or empty); every refresh of that rule would "
            "fail and be dead-lettered: set it, or remove secret_env",
            file=self.source, line=secret.line, field=secret.field)
            for secret in unset(self.secrets, environ)]

    def warnings(self, environ: Mapping[str, str]) -> list[ConfigWarning]:
        """Rules that can never match, and webhook secrets not set in ``environ``."""
        return _warnings(self.source, self.matches, self.secrets, environ, self.sources)

    def match(self, key: str) -> tuple[Rule, dict[str, str]]:
        """The first rule whose pattern matches ``key`` and its captures; UnknownKeyError
        when none does, InvalidKeyError for a key over the length limit."""
        too_long = over_limit(key)  # refused before any matching
        if too_long is not None:
            raise InvalidKeyError(key, too_long)
        found = self._index.first(key)
        if found is None:
            raise self.unknown_key(key)
        return self.rules[found[0]], found[1]

    def rule_for(self, key: str) -> Rule:
        """The first rule whose pattern matches ``key`` (``match`` without the captures)."""
        return self.match(key)[0]

    def unknown_key(self, key: str) -> UnknownKeyError:
        """The error for ``key``, which no rule matches: it names the rules file (when
        the rules came from one) and the rule whose pattern is most like the key."""
        from_file = self.built_in is None and not self.source.startswith("<")
        return UnknownKeyError(key, rules_file=self.source if from_file else None,
                               near=self._near)

    def rule(self, name: str) -> Rule:
        """The rule called ``name``; KeyError if there is none."""
        return self._by_name[name]

    def describe(self) -> str:
        """A human-readable listing of the settings and every resolved rule."""
        head = [
            f"rules file: {self.source}" if self.built_in is None
            else f"rules: built in code, {self.source.strip('<>')}",
            f"namespace: {self.namespace}  shards: {self.shards}  "
            f"leader_lease: {format_duration(self.leader_lease)}  "
            f"claim_lease: {format_duration(self.claim_lease)}",
            f"{len(self.rules)} rule(s), matched in this order (first match wins):",
        ]
        body = [
            _indent(f"{number}. {rule.describe()}", "   ")
            for number, rule in enumerate(self.rules, start=1)
        ]
        return "\n".join(head + body)


def _config(schema: RulesSchema, document: Document | None) -> Config | None:
    """The config of what ``schema`` read (None when it found errors); a non-empty
    $COALESCER_NAMESPACE replaces its namespace."""
    if document is None:
        return None
    namespace = namespace_override(schema.file) or document.namespace
    return Config(namespace=namespace, shards=document.shards,
                  leader_lease=document.leader_lease, claim_lease=document.claim_lease,
                  rules=document.rules, source=schema.file, history=document.history,
                  sources=document.sources, durability=document.durability,
                  limits=document.limits,
                  matches=tuple(schema.matches),
                  secrets=tuple(schema.secrets))


def _check_isolation(rule: Rule) -> None:
    """ConfigError (at its ``isolation`` field) when the rule's handler, now imported,
    cannot run in a child process (an ``async def`` one)."""
    isolation = rule.isolation
    problem = isolation.problem(rule.handler) if isolation is not None else None
    if isolation is not None and problem is not None:
        raise ConfigError(problem, file=isolation.file, line=isolation.line,
                          field=isolation.field)


def _indent(text: str, prefix: str) -> str:
    first, *rest = text.split("\n")
    return "\n".join([prefix + first, *(prefix + "  " + line for line in rest)])


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckReport:
    """What checking a rules file found: the config (None when there are errors), every
    error and every warning, each in file order."""

    config: Config | None
    errors: tuple[ConfigError, ...]
    warnings: tuple[ConfigWarning, ...]


def check_file(path: str | os.PathLike[str], environ: Mapping[str, str], *,
               import_handlers: bool = True) -> CheckReport:
    """Load ``path`` with its handlers imported (only their names checked with
    ``import_handlers=False``: no handler code runs), collecting every error, and the
    warnings of whatever loaded (secrets are looked up in ``environ``)."""
    source = os.fspath(path)
    schema = RulesSchema(source, Path(source).resolve().parent,
                         import_handlers=import_handlers)
    config: Config | None = None
    try:
        config = _config(schema, schema.load(read_text(source)))
    except ConfigError as exc:
        schema.errors.extend(exc.errors)
    problems = schema.outcome()
    return CheckReport(config=config if problems is None else None,
                       errors=tuple(problems.errors) if problems else (),
                       warnings=tuple(_warnings(source, schema.matches, schema.secrets,
                                                environ, config.sources if config else ())))


def check_config(config: Config, environ: Mapping[str, str], *,
                 import_handlers: bool = True) -> CheckReport:
    """The report of rules loaded already (built in code): the errors of importing their
    handler paths (none imported with ``import_handlers=False``), and their warnings."""
    errors: tuple[ConfigError, ...] = ()
    if import_handlers:
        try:
            config = config.with_handlers()
        except ConfigError as exc:
            errors = tuple(exc.errors)
    return CheckReport(config=None if errors else config, errors=errors,
                       warnings=tuple(config.warnings(environ)))


def _warnings(source: str, matches: Sequence[RuleMatch], secrets: Sequence[RuleSecret],
              environ: Mapping[str, str],
              sources: Sequence[SourceConfig] = ()) -> list[ConfigWarning]:
    found = [*unreachable(source, matches), *unset_secret_warnings(source, secrets, environ),
             *unset_env_warnings(source, sources, environ)]
    return sorted(found, key=lambda warning: warning.line or 0)
