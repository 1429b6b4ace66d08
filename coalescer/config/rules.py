"""The rules file: loading, validation with file/line/field, and key matching."""

from __future__ import annotations

import difflib
import functools
import math
import os
import random
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote, urlsplit

import yaml
from yaml.composer import ComposerError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

from coalescer.common.redact import redact
from coalescer.config.durations import ACCEPTED as DURATIONS_ACCEPTED
from coalescer.config.durations import NegativeDurationError, format_duration, parse_duration
from coalescer.config.handler_import import HandlerImport, resolve, split_ref
from coalescer.config.lint import (
    ConfigWarning,
    RuleMatch,
    RuleSecret,
    unreachable,
    unset,
    unset_secret_warnings,
)
from coalescer.config.patterns import KeyPattern
from coalescer.config.sources import Source, load_sources
from coalescer.errors import ConfigError, UnknownKeyError

_P = ParamSpec("_P")
_T = TypeVar("_T")

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
MAX_SHARDS = 16384
HTTP_METHODS = ("POST", "PUT", "PATCH")
_URL_FIELD_RE = re.compile(r"\{([^{}]*)\}")
_MERGE_TAG = "tag:yaml.org,2002:merge"
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_TOP_FIELDS = ("namespace", "shards", "leader_lease", "claim_lease", "history", "defaults",
               "rules", "sources")
_SETTING_FIELDS = ("window", "max_wait", "absorb", "timeout", "concurrency", "retry")
_RULE_FIELDS = ("name", "match", "handler", *_SETTING_FIELDS)
_RETRY_FIELDS = ("attempts", "backoff", "max_backoff")
_HTTP_FIELDS = ("url", "method", "timeout", "secret_env")

TOP_DEFAULTS: dict[str, float] = {
    "shards": 1, "leader_lease": 3.0, "claim_lease": 5.0,
}
RULE_DEFAULTS: dict[str, float] = {
    "window": 2.0, "max_wait": 30.0, "absorb": 0.05, "timeout": 30.0, "concurrency": 16,
    "retry.attempts": 5, "retry.backoff": 1.0, "retry.max_backoff": 300.0,
}
DEFAULT_NAMESPACE = "coalescer"
MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 50
MAX_VALUES = 250_000
DEFAULT_HISTORY = 1000  # refreshes kept per shard in its history stream; 0 keeps none
MAX_HISTORY = 1_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently a failing refresh is tried again (G6)."""

    attempts: int
    backoff: float
    max_backoff: float

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), jittered to 50-100%."""
        exponent = min(max(attempt, 1) - 1, 1023)
        base = min(self.max_backoff, self.backoff * 2.0**exponent)
        jitter = rng.uniform(0.5, 1.0) if rng is not None else random.uniform(0.5, 1.0)
        return base * jitter


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpHandler:
    """The ``http:`` handler form: a webhook called with the claim as its JSON body."""

    url: str
    method: str = "POST"
    timeout: float | None = None
    secret_env: str | None = None

    def url_for(self, params: Mapping[str, str]) -> str:
        """The url with every ``{name}`` replaced by the URL-quoted captured segment."""
        return _URL_FIELD_RE.sub(lambda m: quote(params[m.group(1)], safe=""), self.url)

    def __str__(self) -> str:
        return f"{self.method} {redact(self.url)}"


Handler = Callable[..., object] | HttpHandler | HandlerImport
"""A rule's handler: a Python callable, a webhook, or a Python handler not imported yet
(a process that only writes touches never imports handler modules)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """One resolved rule: every setting filled in from the rule, ``defaults`` or built-ins."""

    name: str
    pattern: KeyPattern
    window: float
    max_wait: float
    absorb: float
    timeout: float
    concurrency: int
    retry: RetryPolicy
    handler: Handler
    handler_ref: str
    line: int

    def params(self, key: str) -> dict[str, str] | None:
        """The captured segments when ``key`` matches this rule, else None."""
        return self.pattern.match(key)

    def describe(self) -> str:
        """A few lines with every resolved setting."""
        retry = self.retry
        lines = [
            f"{self.name}  (line {self.line})",
            f"  match:    {self.pattern.source}",
            f"  handler:  {self.handler_ref}",
            f"  window: {format_duration(self.window)}  "
            f"max_wait: {format_duration(self.max_wait)}  "
            f"absorb: {format_duration(self.absorb)}  "
            f"timeout: {format_duration(self.timeout)}  concurrency: {self.concurrency}",
            f"  retry: attempts {retry.attempts}, backoff {format_duration(retry.backoff)}, "
            f"max_backoff {format_duration(retry.max_backoff)}",
        ]
        if isinstance(self.handler, HttpHandler):
            lines.append("  http: " + _describe_http(self.handler, self.timeout))
        return "\n".join(lines)


def _describe_http(handler: HttpHandler, rule_timeout: float) -> str:
    timeout = handler.timeout if handler.timeout is not None else rule_timeout
    signed = f"signed with ${handler.secret_env}" if handler.secret_env else "unsigned"
    return f"request timeout {format_duration(timeout)}, {signed}"


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
    sources: tuple[Source, ...] = ()
    matches: tuple[RuleMatch, ...] = field(default=(), repr=False, compare=False)
    secrets: tuple[RuleSecret, ...] = field(default=(), repr=False, compare=False)
    _by_name: dict[str, Rule] = field(init=False, repr=False, compare=False)
    _matcher: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _groups: dict[int, tuple[Rule, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alternatives: list[str] = []
        groups: dict[int, tuple[Rule, int]] = {}
        next_group = 1
        for rule in self.rules:
            groups[next_group] = (rule, next_group + 1)
            alternatives.append(f"({rule.pattern.regex.pattern})")
            next_group += 1 + rule.pattern.regex.groups
        object.__setattr__(self, "_by_name", {rule.name: rule for rule in self.rules})
        object.__setattr__(self, "_matcher", re.compile("|".join(alternatives), re.DOTALL))
        object.__setattr__(self, "_groups", groups)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, import_handlers: bool = True) -> Config:
        """Load and validate a rules file; handlers import from the file's folder.

        With ``import_handlers=False`` (a process that only touches keys) no handler
        module is imported: each Python handler stays a ``HandlerImport`` until
        ``with_handlers()``. Raises one ConfigError carrying every problem found.
        """
        source = os.fspath(path)
        text = _read_text(source)
        return cls.from_string(text, source=source, base_dir=Path(source).resolve().parent,
                               import_handlers=import_handlers)

    @classmethod
    def from_string(cls, text: str, *, source: str = "<string>", base_dir: Path | None = None,
                    import_handlers: bool = True) -> Config:
        """Load and validate rules from text; handlers import from ``base_dir`` if given."""
        loader = _Loader(source, base_dir, import_handlers)
        config = loader.load(text)
        problems = loader.outcome()
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
        return _warnings(self.source, self.matches, self.secrets, environ)

    def match(self, key: str) -> tuple[Rule, dict[str, str]]:
        """The first rule whose pattern matches ``key`` and its captures."""
        found = self._matcher.fullmatch(key) if self.rules else None
        if found is None or found.lastindex is None:
            raise UnknownKeyError(key)
        rule, first = self._groups[found.lastindex]
        values = found.groups()[first - 1:first - 1 + len(rule.pattern.names)]
        return rule, dict(zip(rule.pattern.names, values, strict=True))

    def rule_for(self, key: str) -> Rule:
        """The first rule whose pattern matches ``key`` (``match`` without the captures)."""
        found = self._matcher.fullmatch(key) if self.rules else None
        if found is None or found.lastindex is None:
            raise UnknownKeyError(key)
        return self._groups[found.lastindex][0]

    def rule(self, name: str) -> Rule:
        """The rule called ``name``; KeyError if there is none."""
        return self._by_name[name]

    def describe(self) -> str:
        """A human-readable listing of the settings and every resolved rule."""
        head = [
            f"rules file: {self.source}",
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


def _read_text(source: str) -> str:
    """The file's text: at most MAX_FILE_BYTES of UTF-8, or a one-line ConfigError."""
    try:
        with open(source, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("rules file not found", file=source) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a rules file", file=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read rules file: {exc.strerror or exc}",
                          file=source) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"rules file is larger than {MAX_FILE_BYTES // 1024} KiB; "
                          "a rules file is a short YAML text", file=source)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"byte 0x{data[exc.start]:02x} in column {column} is not UTF-8; "
                          "save the rules file as UTF-8 text", file=source,
                          line=line) from None


def _shown(value: object) -> str:
    """A short repr of a value from the file, for error messages."""
    return _SHORT_REPR.repr(value)


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = 80
_SHORT_REPR.maxother = 80


def _indent(text: str, prefix: str) -> str:
    first, *rest = text.split("\n")
    return "\n".join([prefix + first, *(prefix + "  " + line for line in rest)])


# --- loading -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Setting:
    """A resolved setting and where it was set (level 0 built-in, 1 defaults, 2 rule)."""

    value: float
    field: str | None = None
    line: int | None = None
    level: int = 0


Entries = dict[str, tuple[Node, Node]]
Settings = dict[str, _Setting]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


def _kind(value: object) -> str:
    if value is None:
        return "nothing (null)"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping"}
    return names.get(type(value), type(value).__name__)


class _TooDeep(ComposerError):
    """Raised by the composer for a value nested deeper than MAX_DEPTH."""


class _DepthLimitedLoader(yaml.SafeLoader):
    """A SafeLoader whose composer refuses values nested deeper than MAX_DEPTH (instead
    of running out of Python stack)."""

    _depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self._depth >= MAX_DEPTH:
            raise _TooDeep(None, None, f"values are nested more than {MAX_DEPTH} deep",
                           self.peek_event().start_mark)  # type: ignore[no-untyped-call]
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _yaml_problem(exc: yaml.MarkedYAMLError) -> tuple[str, int | None]:
    """One line saying what is wrong (no excerpt of the file), and its line."""
    mark = exc.problem_mark or exc.context_mark
    line = int(mark.line) + 1 if mark is not None else None
    problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
    if exc.context_mark is not None and exc.context_mark is not mark:
        problem += f" (started on line {int(exc.context_mark.line) + 1})"
    return problem, line


class _Expansion:
    """Refuses a document whose aliases expand it past MAX_VALUES values or MAX_DEPTH
    levels ("billion laughs"), or make a value contain itself."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.seen: dict[int, tuple[int, int]] = {}  # id(node): (values, levels)
        self.open: set[int] = set()

    def check(self, root: Node) -> None:
        self.measure(root, 1)

    def refuse(self, node: Node, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, line=_line(node))

    def measure(self, node: Node, depth: int) -> tuple[int, int]:
        """(values, levels) of ``node`` with its aliases expanded; ``depth`` is its own."""
        known = self.seen.get(id(node))
        if id(node) in self.open:
            raise self.refuse(node, "a value contains itself (an alias inside its own "
                                    "anchor); rules need plain values")
        if depth + (known[1] - 1 if known else 0) > MAX_DEPTH:
            raise self.refuse(node, f"values are nested more than {MAX_DEPTH} deep "
                                    "(counting what aliases stand for)")
        if known is not None:
            return known
        self.open.add(id(node))
        values, levels = 1, 0
        for child in _children(node):
            child_values, child_levels = self.measure(child, depth + 1)
            values, levels = values + child_values, max(levels, child_levels)
            if values > MAX_VALUES:
                raise self.refuse(node, f"the file holds more than {MAX_VALUES} values "
                                        "once its aliases are expanded; rules files are small")
        self.open.discard(id(node))
        self.seen[id(node)] = (values, levels + 1)
        return values, levels + 1


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _any_bad(settings: Settings) -> bool:
    """Whether a setting failed to load (kept as NaN; see _Loader.settings)."""
    return any(math.isnan(setting.value) for setting in settings.values())


class _Abandon(Exception):
    """Errors of this part are recorded already: skip what depends on it."""


class _Loader:
    """Walks the composed YAML nodes so every error carries its line and field. It goes
    on past an error to find the others, and skips only what depends on the bad part."""

    def __init__(self, file: str, base_dir: Path | None, import_handlers: bool) -> None:
        self.file = file
        self.base_dir = base_dir
        self.import_handlers = import_handlers
        self.errors: list[ConfigError] = []
        self.matches: list[RuleMatch] = []
        self.secrets: list[RuleSecret] = []

    def error(self, message: str, node: Node | None = None,
              field: str | None = None) -> ConfigError:
        line = _line(node) if node is not None else None
        return ConfigError(message, file=self.file, line=line, field=field)

    def attempt(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T | None:
        """``fn(...)``, or None once the errors it raised are recorded."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            self.errors.extend(exc.errors)
        except _Abandon:
            pass
        return None

    def settle(self, before: int) -> None:
        """Abandon the part being read if it recorded errors (since ``before`` of them)."""
        if len(self.errors) > before:
            raise _Abandon

    def outcome(self) -> ConfigError | None:
        """Every recorded error, once each, in file order, as one ConfigError."""
        unique = list({str(error): error for error in self.errors}.values())
        unique.sort(key=lambda error: error.line or 0)
        return ConfigError.combine(unique) if unique else None

    # -- YAML plumbing --

    def compose(self, text: str) -> Node:
        try:
            root = yaml.compose(text, Loader=_DepthLimitedLoader)
        except _TooDeep as exc:
            problem, line = _yaml_problem(exc)
            raise ConfigError(f"{problem}; a rules file needs only a few levels",
                              file=self.file, line=line) from None
        except yaml.MarkedYAMLError as exc:
            problem, line = _yaml_problem(exc)
            raise ConfigError(f"YAML syntax error: {problem}; the file must be valid YAML",
                              file=self.file, line=line) from None
        except ReaderError as exc:
            line = text.count("\n", 0, exc.position) + 1
            code = exc.character if isinstance(exc.character, int) else ord(exc.character)
            raise ConfigError(f"character U+{code:04X} is not allowed in YAML; remove it",
                              file=self.file, line=line) from None
        except (yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"YAML error: {exc}", file=self.file) from None
        if root is None:
            raise ConfigError("the file is empty; expected a mapping with a 'rules' list",
                              file=self.file)
        _Expansion(self.file).check(root)
        return root

    def value(self, node: Node, field: str) -> Any:
        loader = yaml.SafeLoader("")
        try:
            return loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            problem = _yaml_problem(exc)[0] if isinstance(exc, yaml.MarkedYAMLError) else exc
            raise self.error(f"cannot read value: {problem}", node, field) from None
        finally:
            loader.dispose()

    def mapping(self, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> Entries:
        """The fields of a mapping; unknown or repeated fields are recorded and left out."""
        if not isinstance(node, MappingNode):
            got = _kind(self.value(node, prefix))
            raise self.error(f"{what} must be a mapping, got {got}", node, prefix or None)
        self.no_twice(node, prefix)
        self.flatten(node, prefix)
        entries: Entries = {}
        for key_node, value_node in node.value:  # merged keys first, so explicit ones win
            name = self.attempt(self.key_name, key_node, prefix)
            if name is None:
                continue
            if name not in allowed:
                self.errors.append(self.unknown(name, key_node, prefix, allowed, what))
                continue
            entries[name] = (key_node, value_node)
        return entries

    def no_twice(self, node: MappingNode, prefix: str) -> None:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            name = self.attempt(self.key_name, key_node, prefix)
            if name is None:
                continue
            if name in seen:
                self.errors.append(self.error(f"field {_shown(name)} is given twice; give it "
                                              "once", key_node, _join(prefix, name)))
            seen.add(name)

    def flatten(self, node: MappingNode, prefix: str) -> None:
        """Apply YAML merge keys (``<<: *anchor``) in place."""
        loader = yaml.SafeLoader("")
        try:
            loader.flatten_mapping(node)
        except yaml.YAMLError as exc:
            problem = _yaml_problem(exc)[0] if isinstance(exc, yaml.MarkedYAMLError) else exc
            raise self.error(f"bad merge key: {problem}", node, prefix or None) from None
        finally:
            loader.dispose()

    def key_name(self, node: Node, prefix: str) -> str:
        if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:str":
            return str(node.value)
        shown = node.value if isinstance(node, ScalarNode) else _kind(self.value(node, prefix))
        raise self.error(f"field names must be plain strings, got {_shown(shown)}", node,
                         prefix or None)

    def unknown(self, name: str, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> ConfigError:
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return self.error(f"unknown field {_shown(name)} in {what}{hint}; allowed: "
                          f"{', '.join(allowed)}", node, _join(prefix, name))

    def require(self, entries: Entries, name: str, node: Node, prefix: str,
                what: str) -> Node:
        if name not in entries:
            raise self.error(f"{what} is missing the required field {_shown(name)}", node,
                             _join(prefix, name))
        return entries[name][1]

    def optional(self, entries: Entries, prefix: str, name: str,
                 parse: Callable[[Node, str], _T], default: _T) -> _T:
        """The field ``name`` read by ``parse``; ``default`` when absent or bad (recorded)."""
        if name not in entries:
            return default
        found = self.attempt(parse, entries[name][1], _join(prefix, name))
        return default if found is None else found

    # -- typed values --

    def duration(self, node: Node, field: str, *, positive: bool) -> float:
        raw = self.value(node, field)
        try:
            seconds = parse_duration(raw)
        except NegativeDurationError:
            raise self.error(f"negative duration {_shown(raw)}: a duration is never below 0; "
                             f"expected {DURATIONS_ACCEPTED}", node, field) from None
        except ValueError:
            raise self.error(f"bad duration {_shown(raw)}: expected {DURATIONS_ACCEPTED}",
                             node, field) from None
        if positive and seconds <= 0:
            raise self.error(f"must be longer than 0, got {_shown(raw)}; expected "
                             f"{DURATIONS_ACCEPTED}, above 0", node, field)
        return seconds

    def positive_duration(self, node: Node, field: str) -> float:
        return self.duration(node, field, positive=True)

    def positive_int(self, node: Node, field: str, limit: int | None = None) -> int:
        raw = self.value(node, field)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise self.error(f"must be a positive whole number (1, 2, ...), got {_shown(raw)}",
                             node, field)
        if limit is not None and raw > limit:
            raise self.error(f"must be at most {limit}, got {raw}", node, field)
        return raw

    def string(self, node: Node, field: str, what: str) -> str:
        raw = self.value(node, field)
        if not isinstance(raw, str) or not raw:
            raise self.error(f"{what} must be a non-empty string, got {_kind(raw)} "
                             f"({_shown(raw)})", node, field)
        return raw

    def identifier(self, node: Node, field: str, what: str) -> str:
        raw = self.string(node, field, what)
        if NAME_RE.fullmatch(raw) is None:
            raise self.error(f"{what} {_shown(raw)} may only use letters, digits, '_', '.' and '-' "
                             f"(it becomes part of Redis keys)", node, field)
        return raw

    # -- the document --

    def load(self, text: str) -> Config | None:
        """The config, or None when errors were recorded. Raises ConfigError only when
        nothing more can be read (not YAML, not a mapping)."""
        root = self.compose(text)
        entries = self.mapping(root, "", _TOP_FIELDS, "the top level")
        namespace = self.optional(entries, "", "namespace", self.namespace, DEFAULT_NAMESPACE)
        shards = self.optional(entries, "", "shards", self.shards, int(TOP_DEFAULTS["shards"]))
        leases = {name: self.optional(entries, "", name, self.positive_duration,
                                      TOP_DEFAULTS[name])
                  for name in ("leader_lease", "claim_lease")}
        history = self.optional(entries, "", "history", self.history, DEFAULT_HISTORY)
        defaults = self.defaults(entries)
        node = self.attempt(self.require, entries, "rules", root, "", "the rules file")
        rules = self.attempt(self.rules, node, defaults) if node is not None else None
        sources: tuple[Source, ...] | None = ()
        if rules is not None and not self.errors and "sources" in entries:
            sources = self.attempt(load_sources, self, entries["sources"][1],
                                   [r.pattern for r in rules])
        if self.errors or rules is None or sources is None:
            return None
        return Config(namespace=namespace, shards=shards, leader_lease=leases["leader_lease"],
                      claim_lease=leases["claim_lease"], rules=rules, source=self.file,
                      history=history, sources=sources, matches=tuple(self.matches),
                      secrets=tuple(self.secrets))

    def namespace(self, node: Node, field: str) -> str:
        return self.identifier(node, field, "namespace")

    def shards(self, node: Node, field: str) -> int:
        return self.positive_int(node, field, MAX_SHARDS)

    def history(self, node: Node, field: str) -> int:
        raw = self.value(node, field)
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_HISTORY:
            raise self.error(f"must be a whole number from 0 (no history) to {MAX_HISTORY}: "
                             f"refreshes kept per shard, got {raw!r}", node, field)
        return raw

    def defaults(self, entries: Entries) -> Settings:
        settings = {name: _Setting(value) for name, value in RULE_DEFAULTS.items()}
        if "defaults" not in entries:
            return settings
        node = entries["defaults"][1]
        if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return settings
        found = self.attempt(self.mapping, node, "defaults", _SETTING_FIELDS, "defaults")
        return settings | self.settings(found or {}, "defaults", level=1)

    def settings(self, entries: Entries, prefix: str, level: int) -> Settings:
        """The settings given in ``entries``; a bad one is recorded and kept as NaN, which
        fails every comparison, so no cross-field check blames it again."""
        out: Settings = {}
        for name in ("window", "max_wait", "absorb", "timeout", "concurrency"):
            if name in entries:
                out[name] = self.setting(entries[name][1], _join(prefix, name), level,
                                         self.setting_parser(name))
        if "retry" in entries:
            out |= self.attempt(self.retry, entries["retry"][1], _join(prefix, "retry"),
                                level) or {}
        return out

    def setting_parser(self, name: str) -> Callable[[Node, str], float]:
        if name == "concurrency":
            return self.positive_int
        if name == "absorb":
            return functools.partial(self.duration, positive=False)
        return self.positive_duration

    def setting(self, node: Node, field: str, level: int,
                parse: Callable[[Node, str], float]) -> _Setting:
        value = self.attempt(parse, node, field)
        return _Setting(math.nan if value is None else value, field, _line(node), level)

    def retry(self, node: Node, prefix: str, level: int) -> Settings:
        entries = self.mapping(node, prefix, _RETRY_FIELDS, "retry")
        out: Settings = {}
        for name, (_, value) in entries.items():
            parse = (self.positive_int if name == "attempts"
                     else functools.partial(self.duration, positive=False))
            out[f"retry.{name}"] = self.setting(value, _join(prefix, name), level, parse)
        return out

    def rules(self, node: Node, defaults: Settings) -> tuple[Rule, ...]:
        if not isinstance(node, SequenceNode):
            got = _kind(self.value(node, "rules"))
            raise self.error(f"rules must be a list of rules, got {got}", node, "rules")
        if not node.value:
            raise self.error("rules is empty; give at least one rule (match: \"*\" accepts "
                             "every key)", node, "rules")
        seen: dict[str, int] = {}
        found = [self.attempt(self.rule, item, index, defaults, seen)
                 for index, item in enumerate(node.value)]
        return tuple(rule for rule in found if rule is not None)

    def rule(self, node: Node, index: int, defaults: Settings, seen: dict[str, int]) -> Rule:
        prefix, before = f"rules[{index}]", len(self.errors)
        entries = self.mapping(node, prefix, _RULE_FIELDS, "a rule")
        name = self.attempt(self.rule_name, entries, node, prefix, seen)
        pattern = self.attempt(self.rule_pattern, entries, node, index, name or prefix)
        settings = defaults | self.settings(entries, prefix, level=2)
        self.check(settings, node)
        handler = self.attempt(self.rule_handler, entries, node, index, name or prefix,
                               pattern)
        self.settle(before)
        if name is None or pattern is None or handler is None or _any_bad(settings):
            raise _Abandon
        retry = RetryPolicy(attempts=int(settings["retry.attempts"].value),
                            backoff=settings["retry.backoff"].value,
                            max_backoff=settings["retry.max_backoff"].value)
        return Rule(name=name, pattern=pattern, window=settings["window"].value,
                    max_wait=settings["max_wait"].value, absorb=settings["absorb"].value,
                    timeout=settings["timeout"].value,
                    concurrency=int(settings["concurrency"].value), retry=retry,
                    handler=handler[0], handler_ref=handler[1], line=_line(node))

    def rule_name(self, entries: Entries, node: Node, prefix: str,
                  seen: dict[str, int]) -> str:
        field = f"{prefix}.name"
        name_node = self.require(entries, "name", node, prefix, "the rule")
        name = self.identifier(name_node, field, "rule name")
        if name in seen:
            raise self.error(f"duplicate rule name {_shown(name)} (first used on line "
                             f"{seen[name]}); rule names must be unique", name_node, field)
        seen[name] = _line(name_node)
        return name

    def rule_pattern(self, entries: Entries, node: Node, index: int, name: str) -> KeyPattern:
        match_node = self.require(entries, "match", node, f"rules[{index}]", "the rule")
        source = self.string(match_node, f"rules[{index}].match", "match")
        try:
            pattern = KeyPattern.compile(source)
        except ValueError as exc:
            raise self.error(str(exc), match_node, f"rules[{index}].match") from None
        self.matches.append(RuleMatch(index, name, pattern, _line(match_node)))
        return pattern

    # -- cross-field checks --

    def check(self, settings: Settings, node: Node) -> None:
        window, absorb = settings["window"], settings["absorb"]
        if absorb.value >= window.value:
            self.blame(absorb, window, node,
                       f"absorb ({format_duration(absorb.value)}) must be shorter than "
                       f"window ({format_duration(window.value)}); "
                       "lengthen window or shorten absorb")
        max_wait = settings["max_wait"]
        if max_wait.value < window.value:
            self.blame(max_wait, window, node,
                       f"max_wait ({format_duration(max_wait.value)}) must be at least "
                       f"window ({format_duration(window.value)}); "
                       "raise max_wait or shorten window")
        backoff, cap = settings["retry.backoff"], settings["retry.max_backoff"]
        if backoff.value > cap.value:
            self.blame(backoff, cap, node,
                       f"retry backoff ({format_duration(backoff.value)}) must not exceed "
                       f"retry max_backoff ({format_duration(cap.value)})")

    def blame(self, first: _Setting, second: _Setting, node: Node, message: str) -> None:
        """Record the error at whichever of the two settings was given most specifically."""
        culprit = second if second.level > first.level else first
        line = culprit.line if culprit.line is not None else _line(node)
        self.errors.append(ConfigError(message, file=self.file, line=line,
                                       field=culprit.field))

    # -- handlers --

    def rule_handler(self, entries: Entries, node: Node, index: int, name: str,
                     pattern: KeyPattern | None) -> tuple[Handler, str]:
        prefix = f"rules[{index}]"
        handler_node = self.require(entries, "handler", node, prefix, "the rule")
        field = f"{prefix}.handler"
        if isinstance(handler_node, MappingNode):
            found = self.mapping(handler_node, field, ("http",), "handler")
            if "http" not in found:
                raise self.error("handler mapping needs an 'http' block", handler_node, field)
            http = self.http(found["http"][1], f"{field}.http", pattern, (index, name))
            return http, str(http)
        ref = self.string(handler_node, field, "handler")
        if not split_ref(ref)[0]:
            raise self.error(f"handler {_shown(ref)} must have the form 'module:function' "
                             f"(e.g. myapp.stats:refresh_user), or be an http: block",
                             handler_node, field)
        spec = HandlerImport(ref=ref, file=self.file, line=_line(handler_node), field=field,
                             base_dir=self.base_dir)
        return (resolve(spec) if self.import_handlers else spec), ref

    def http(self, node: Node, prefix: str, pattern: KeyPattern | None,
             rule: tuple[int, str]) -> HttpHandler:
        """The http block; ``rule`` is the rule's index and name, for its secret."""
        before = len(self.errors)
        entries = self.mapping(node, prefix, _HTTP_FIELDS, "the http handler")
        url = self.attempt(self.http_url, entries, node, prefix, pattern)
        method = self.optional(entries, prefix, "method", self.method, "POST")
        timeout = self.optional(entries, prefix, "timeout", self.positive_duration, None)
        secret_env = self.optional(entries, prefix, "secret_env", self.env_name, None)
        if secret_env is not None:
            self.secrets.append(RuleSecret(*rule, secret_env, _line(entries["secret_env"][1])))
        self.settle(before)
        if url is None:
            raise _Abandon
        return HttpHandler(url=url, method=method, timeout=timeout, secret_env=secret_env)

    def http_url(self, entries: Entries, node: Node, prefix: str,
                 pattern: KeyPattern | None) -> str:
        return self.url(self.require(entries, "url", node, prefix, "the http handler"),
                        f"{prefix}.url", pattern)

    def url(self, node: Node, field: str, pattern: KeyPattern | None) -> str:
        url = self.string(node, field, "url")
        for name in _URL_FIELD_RE.findall(url):
            if pattern is not None and name not in pattern.names:
                known = ", ".join(f"{{{n}}}" for n in pattern.names) or "none"
                raise self.error(f"url uses {{{name}}}, which is not a capture of the rule's "
                                 f"pattern {pattern.source!r} (its captures: {known})",
                                 node, field)
        bare = _URL_FIELD_RE.sub("x", url)
        if "{" in bare or "}" in bare:
            raise self.error(f"unbalanced brace in url {_shown(redact(url))}; "
                             "use {name} for a capture", node, field)
        parts = urlsplit(bare)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise self.error(f"url {_shown(redact(url))} must be an absolute http:// or "
                             "https:// URL", node, field)
        return url

    def method(self, node: Node, field: str) -> str:
        raw = self.string(node, field, "method")
        if raw.upper() not in HTTP_METHODS:
            raise self.error(f"method {_shown(raw)} is not allowed; use one of "
                             f"{', '.join(HTTP_METHODS)}", node, field)
        return raw.upper()

    def env_name(self, node: Node, field: str) -> str:
        raw = self.string(node, field, "secret_env")
        if _ENV_RE.fullmatch(raw) is None:
            raise self.error(f"secret_env {_shown(raw)} must be the name of an environment "
                             f"variable (letters, digits and '_')", node, field)
        return raw


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckReport:
    """What checking a rules file found: the config (None when there are errors), every
    error and every warning, each in file order."""

    config: Config | None
    errors: tuple[ConfigError, ...]
    warnings: tuple[ConfigWarning, ...]


def check_file(path: str | os.PathLike[str], environ: Mapping[str, str]) -> CheckReport:
    """Load ``path`` with its handlers imported, collecting every error, and the warnings
    of whatever loaded (secrets are looked up in ``environ``)."""
    source = os.fspath(path)
    loader = _Loader(source, Path(source).resolve().parent, import_handlers=True)
    config: Config | None = None
    try:
        config = loader.load(_read_text(source))
    except ConfigError as exc:
        loader.errors.extend(exc.errors)
    problems = loader.outcome()
    return CheckReport(config=config if problems is None else None,
                       errors=tuple(problems.errors) if problems else (),
                       warnings=tuple(_warnings(source, loader.matches, loader.secrets,
                                                environ)))


def _warnings(source: str, matches: Sequence[RuleMatch], secrets: Sequence[RuleSecret],
              environ: Mapping[str, str]) -> list[ConfigWarning]:
    found = [*unreachable(source, matches), *unset_secret_warnings(source, secrets, environ)]
    return sorted(found, key=lambda warning: warning.line or 0)
