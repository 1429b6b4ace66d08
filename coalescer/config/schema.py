"""The rules schema: builds a rules file's settings, rules and sources from its YAML
nodes, every error with the file, line and field at fault (``coalescer.config.rules``
turns the result into a ``Config``)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from coalescer.common.redact import redact
from coalescer.config import kafka_source  # noqa: F401  (registers type: kafka)
from coalescer.config.durability import MAX_REPLICAS, MAX_TIMEOUT, NO_REPLICAS, Durability
from coalescer.config.durations import format_duration
from coalescer.config.edges import EDGE_CODES, EDGES, edge_name
from coalescer.config.fair import FairReader
from coalescer.config.handler_import import HandlerImport, resolve, split_ref
from coalescer.config.limits import (
    DEFAULT_LIMITS,
    LIMIT_FIELDS,
    MAX_BYTES,
    MAX_COUNT,
    MAX_SCHEDULE_AHEAD,
    Limits,
)
from coalescer.config.lint import RuleMatch, RuleSecret
from coalescer.config.model import (
    RATE_UNITS,
    URL_FIELD_RE,
    BatchPolicy,
    Handler,
    HttpHandler,
    ItemsPolicy,
    ProcessIsolation,
    RateLimit,
    RetryPolicy,
    Rule,
)
from coalescer.config.patterns import KeyPattern
from coalescer.config.sizes import format_size, parse_size
from coalescer.config.sources import SourceConfig, load_sources
from coalescer.config.yaml_reader import (
    Abandon,
    Entries,
    YamlReader,
    join,
    kind,
    line_of,
    shown,
)
from coalescer.errors import ConfigError

MAX_SHARDS = 16384
HTTP_METHODS = ("POST", "PUT", "PATCH")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

WAIT_SHARE = 0.25  # of claim_lease: the longest wait for replicas a rules file may ask
_TOP_FIELDS = ("namespace", "shards", "leader_lease", "claim_lease", "history", "durability",
               "limits", "defaults", "rules", "sources")
_DURABILITY_FIELDS = ("replicas", "timeout")
_SETTING_FIELDS = ("window", "max_wait", "absorb", "timeout", "concurrency", "retry",
                   "edge")
_RULE_FIELDS = ("name", "match", "handler", "rate", *_SETTING_FIELDS, "batch", "items",
                "isolation", "fair", "priority")
ISOLATIONS = ("thread", "process")
_BATCH_FIELDS = ("max", "wait")
_ITEMS_FIELDS = ("max",)
MAX_ITEMS = 100_000  # distinct items a key's refresh gets at most
MAX_BATCH = 10_000  # keys in one batch handler call
MAX_BATCH_WAIT = 10.0  # seconds a batch waits for more keys, at most
_RETRY_FIELDS = ("attempts", "backoff", "max_backoff")
_HTTP_FIELDS = ("url", "method", "timeout", "secret_env")

TOP_DEFAULTS: dict[str, float] = {
    "shards": 1, "leader_lease": 3.0, "claim_lease": 5.0,
}
RULE_DEFAULTS: dict[str, float] = {
    "window": 2.0, "max_wait": 30.0, "absorb": 0.05, "timeout": 30.0, "concurrency": 16,
    "retry.attempts": 5, "retry.backoff": 1.0, "retry.max_backoff": 300.0,
    "edge": EDGE_CODES["trailing"],
}
DEFAULT_NAMESPACE = "coalescer"
DEFAULT_HISTORY = 1000  # refreshes kept per shard in its history stream; 0 keeps none
MAX_HISTORY = 1_000_000
MAX_RATE = 1_000_000  # starts per period of a rule's rate
_RATE_RE = re.compile(r"\s*(\d+)\s*/\s*([a-z]+)\s*")


@dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """What a rules file says, checked: its settings, rules and sources."""

    namespace: str
    shards: int
    leader_lease: float
    claim_lease: float
    history: int
    rules: tuple[Rule, ...]
    sources: tuple[SourceConfig, ...]
    durability: Durability = NO_REPLICAS
    limits: Limits = DEFAULT_LIMITS


@dataclass(frozen=True, slots=True)
class _Setting:
    """A resolved setting and where it was set (level 0 built-in, 1 defaults, 2 rule)."""

    value: float
    field: str | None = None
    line: int | None = None
    level: int = 0


Settings = dict[str, _Setting]


def _captures_outside_path(url: str) -> tuple[str, str] | None:
    """The first ``{name}`` of ``url`` that is not in its path, and where it is."""
    names = URL_FIELD_RE.findall(url)
    marked = URL_FIELD_RE.sub(lambda m: f"zz{names.index(m.group(1))}capturezz", url)
    parts = urlsplit(marked)
    for number, name in enumerate(names):
        marker = f"zz{number}capturezz"
        for where, text in (("scheme", parts.scheme), ("host", parts.netloc),
                            ("query", parts.query), ("fragment", parts.fragment)):
            if marker in text:
                return name, where
    return None


def _any_bad(settings: Settings) -> bool:
    """Whether a setting failed to load (kept as NaN; see RulesSchema.settings)."""
    return any(math.isnan(setting.value) for setting in settings.values())


class RulesSchema(YamlReader):
    """Reads a rules file's nodes into a ``Document``. It goes on past an error to find
    the others, and skips only what depends on the bad part. ``matches`` and ``secrets``
    collect what the lints look at, even from a file with errors."""

    def __init__(self, file: str, base_dir: Path | None, import_handlers: bool) -> None:
        super().__init__(file)
        self.base_dir = base_dir
        self.import_handlers = import_handlers
        self.matches: list[RuleMatch] = []
        self.secrets: list[RuleSecret] = []

    # -- the document --

    def load(self, text: str) -> Document | None:
        """The document, or None when errors were recorded. Raises ConfigError only when
        nothing more can be read (not YAML, not a mapping)."""
        return self.read(self.compose(text))

    def read(self, root: Node) -> Document | None:
        """``load`` of a composed document: the hook for rules given as other nodes (rules
        in code, ``coalescer.config.code_rules``, build their nodes from Python values)."""
        entries = self.mapping(root, "", _TOP_FIELDS, "the top level")
        namespace = self.optional(entries, "", "namespace", self.namespace, DEFAULT_NAMESPACE)
        shards = self.optional(entries, "", "shards", self.shards, int(TOP_DEFAULTS["shards"]))
        leases = {name: self.optional(entries, "", name, self.positive_duration,
                                      TOP_DEFAULTS[name])
                  for name in ("leader_lease", "claim_lease")}
        history = self.optional(entries, "", "history", self.history, DEFAULT_HISTORY)
        durability = self.optional(entries, "", "durability", self.durability, NO_REPLICAS)
        self.check_wait(entries, durability, leases["claim_lease"])
        limits = self.optional(entries, "", "limits", self.limits, DEFAULT_LIMITS)
        defaults = self.defaults(entries)
        node = self.attempt(self.require, entries, "rules", root, "", "the rules file")
        rules = self.attempt(self.rules, node, defaults) if node is not None else None
        sources: tuple[SourceConfig, ...] | None = ()
        if rules is not None and not self.errors and "sources" in entries:
            sources = self.attempt(load_sources, self, entries["sources"][1],
                                   [r.pattern for r in rules],
                                   [r.pattern for r in rules if r.items is not None])
        if self.errors or rules is None or sources is None:
            return None
        return Document(namespace=namespace, shards=shards,
                        leader_lease=leases["leader_lease"], claim_lease=leases["claim_lease"],
                        history=history, rules=rules, sources=sources, durability=durability,
                        limits=limits)

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

    def durability(self, node: Node, field: str) -> Durability:
        """``durability: {replicas: N, timeout: DURATION}``: replicas defaults to 0."""
        entries = self.mapping(node, field, _DURABILITY_FIELDS, "durability")
        replicas = self.optional(entries, field, "replicas", self.replicas, 0)
        timeout = self.optional(entries, field, "timeout", self.replica_timeout,
                                NO_REPLICAS.timeout)
        return Durability(replicas=replicas, timeout=timeout)

    def check_wait(self, entries: Entries, durability: Durability, claim_lease: float) -> None:
        """A claim waits for its replicas before it runs, while its lease runs: a wait of
        more than a quarter of ``claim_lease`` would leave a claim too little lease to
        start in (it would lapse, and count an attempt, before it ran)."""
        if durability.replicas and durability.timeout > claim_lease * WAIT_SHARE:
            self.errors.append(self.error(
                f"must be at most a quarter of claim_lease ({format_duration(claim_lease)}): "
                f"a claim waits for its replicas while its lease runs, got "
                f"{format_duration(durability.timeout)}", entries["durability"][1],
                "durability.timeout"))

    def limits(self, node: Node, field: str) -> Limits:
        """``limits: {pending_keys: N, pending_bytes: SIZE, max_schedule_ahead: DURATION,
        dead_letters: N, dead_letter_ttl: DURATION}``."""
        entries = self.mapping(node, field, LIMIT_FIELDS, "limits")
        counts = {name: self.optional(entries, field, name, self.limit_count,
                                      getattr(DEFAULT_LIMITS, name))
                  for name in ("pending_keys", "dead_letters")}
        ttl = self.optional(entries, field, "dead_letter_ttl", self.positive_duration,
                            DEFAULT_LIMITS.dead_letter_ttl)
        size = self.optional(entries, field, "pending_bytes", self.limit_bytes,
                             DEFAULT_LIMITS.pending_bytes)
        ahead = self.optional(entries, field, "max_schedule_ahead", self.schedule_ahead,
                              DEFAULT_LIMITS.max_schedule_ahead)
        return Limits(dead_letter_ttl=ttl, pending_bytes=size, max_schedule_ahead=ahead,
                      **counts)

    def limit_count(self, node: Node, field: str) -> int:
        return self.positive_int(node, field, MAX_COUNT)

    def limit_bytes(self, node: Node, field: str) -> int:
        """A size (config/sizes.py) from 1 byte to MAX_BYTES."""
        raw = self.value(node, field)
        try:
            size = parse_size(raw)
        except ValueError as exc:
            raise self.error(str(exc), node, field) from None
        if not 1 <= size <= MAX_BYTES:
            raise self.error(f"must be from 1 byte to {format_size(MAX_BYTES)}, got "
                             f"{shown(raw)}", node, field)
        return size

    def schedule_ahead(self, node: Node, field: str) -> float:
        """A duration > 0 of at most MAX_SCHEDULE_AHEAD (10 years)."""
        ahead = self.positive_duration(node, field)
        if ahead > MAX_SCHEDULE_AHEAD:
            raise self.error(f"must be at most {format_duration(MAX_SCHEDULE_AHEAD)} (10 "
                             f"years), got {format_duration(ahead)}", node, field)
        return ahead

    def replicas(self, node: Node, field: str) -> int:
        raw = self.value(node, field)
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_REPLICAS:
            raise self.error(f"must be a whole number from 0 (no waiting) to {MAX_REPLICAS}: "
                             f"replicas that must hold each write, got {shown(raw)}", node,
                             field)
        return raw

    def replica_timeout(self, node: Node, field: str) -> float:
        timeout = self.positive_duration(node, field)
        if timeout > MAX_TIMEOUT:
            raise self.error(f"must be at most {format_duration(MAX_TIMEOUT)}, got "
                             f"{format_duration(timeout)}: each write waits this long for "
                             "its replicas", node, field)
        return timeout

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
                out[name] = self.setting(entries[name][1], join(prefix, name), level,
                                         self.setting_parser(name))
        if "retry" in entries:
            out |= self.attempt(self.retry, entries["retry"][1], join(prefix, "retry"),
                                level) or {}
        if "edge" in entries:
            out["edge"] = self.setting(entries["edge"][1], join(prefix, "edge"), level,
                                       self.edge)
        return out

    def edge(self, node: Node, field: str) -> float:
        """``trailing`` (the default) or ``leading`` (config/edges.py)."""
        raw = self.value(node, field)
        if raw not in EDGES:
            raise self.error(f"edge must be trailing or leading, got {shown(raw)}", node,
                             field)
        return EDGE_CODES[raw]

    def setting_parser(self, name: str) -> Callable[[Node, str], float]:
        if name == "concurrency":
            return self.positive_int
        if name == "absorb":
            return functools.partial(self.duration, positive=False)
        return self.positive_duration

    def setting(self, node: Node, field: str, level: int,
                parse: Callable[[Node, str], float]) -> _Setting:
        value = self.attempt(parse, node, field)
        return _Setting(math.nan if value is None else value, field, line_of(node), level)

    def retry(self, node: Node, prefix: str, level: int) -> Settings:
        entries = self.mapping(node, prefix, _RETRY_FIELDS, "retry")
        out: Settings = {}
        for name, (_, value) in entries.items():
            parse = (self.positive_int if name == "attempts"
                     else functools.partial(self.duration, positive=False))
            out[f"retry.{name}"] = self.setting(value, join(prefix, name), level, parse)
        return out

    def rules(self, node: Node, defaults: Settings) -> tuple[Rule, ...]:
        if not isinstance(node, SequenceNode):
            got = kind(self.value(node, "rules"))
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
        rate = self.optional(entries, prefix, "rate", self.rate, None)
        handler = self.attempt(self.rule_handler, entries, node, index, name or prefix,
                               pattern)
        batch = self.optional(entries, prefix, "batch", self.batch, None)
        items = self.optional(entries, prefix, "items", self.items, None)
        fair = self.optional(entries, prefix, "fair", functools.partial(
            FairReader(self).fair, pattern=pattern), None)
        priority = self.optional(entries, prefix, "priority", FairReader(self).priority, None)
        if batch is not None and handler is not None:
            self.attempt(self.batch_handler, handler[0], entries, prefix)
        isolation = (self.optional(entries, prefix, "isolation", self.isolation, None)
                     if "isolation" in entries else self.default_isolation(node, prefix))
        if isolation is not None and handler is not None:
            self.attempt(self.isolated_handler, handler[0], isolation)
        self.settle(before)
        if name is None or pattern is None or handler is None or _any_bad(settings):
            raise Abandon
        retry = RetryPolicy(attempts=int(settings["retry.attempts"].value),
                            backoff=settings["retry.backoff"].value,
                            max_backoff=settings["retry.max_backoff"].value)
        return Rule(name=name, pattern=pattern, window=settings["window"].value,
                    max_wait=settings["max_wait"].value, absorb=settings["absorb"].value,
                    timeout=settings["timeout"].value,
                    concurrency=int(settings["concurrency"].value), retry=retry,
                    handler=handler[0], handler_ref=handler[1], line=line_of(node),
                    rate=rate, batch=batch, items=items, isolation=isolation,
                    edge=edge_name(settings["edge"].value), fair=fair, priority=priority)

    def batch(self, node: Node, prefix: str) -> BatchPolicy:
        """``batch: {max: N, wait: DURATION}``: max is required, wait defaults to 0."""
        entries = self.mapping(node, prefix, _BATCH_FIELDS, "batch")
        size_node = self.require(entries, "max", node, prefix, "batch")
        size = self.positive_int(size_node, join(prefix, "max"), MAX_BATCH)
        wait = self.optional(entries, prefix, "wait", self.batch_wait, 0.0)
        return BatchPolicy(max=size, wait=wait)

    def items(self, node: Node, prefix: str) -> ItemsPolicy:
        """``items: {max: N}``: max is required."""
        entries = self.mapping(node, prefix, _ITEMS_FIELDS, "items")
        size_node = self.require(entries, "max", node, prefix, "items")
        return ItemsPolicy(max=self.positive_int(size_node, join(prefix, "max"), MAX_ITEMS))

    def batch_handler(self, handler: Handler, entries: Entries, prefix: str) -> None:
        """A batch webhook gets one request for many keys: its url cannot name a capture."""
        if isinstance(handler, HttpHandler) and URL_FIELD_RE.search(handler.url):
            raise self.error("a batch rule's webhook gets one request for many keys, so its "
                             "url cannot use a {capture}; read each key's captures from the "
                             "claims' params in the body", entries["batch"][0],
                             join(prefix, "batch"))

    def default_isolation(self, node: Node, prefix: str) -> ProcessIsolation:
        """A rule without ``isolation``: a plain function runs in child processes."""
        return ProcessIsolation(base_dir=self.base_dir, file=self.file, line=line_of(node),
                                field=join(prefix, "isolation"), explicit=False)

    def isolation(self, node: Node, field: str) -> ProcessIsolation | None:
        """``process`` (the default: a plain handler runs in child processes the node
        kills at the timeout and when its claim is lost) or ``thread`` (on the node's
        own threads)."""
        raw = self.value(node, field)
        if raw not in ISOLATIONS:
            raise self.error(f"isolation must be thread or process, got {shown(raw)}", node,
                             field)
        if raw == "thread":
            return None
        return ProcessIsolation(base_dir=self.base_dir, file=self.file, line=line_of(node),
                                field=field)

    def isolated_handler(self, handler: Handler, isolation: ProcessIsolation) -> None:
        problem = isolation.problem(handler)
        if problem is not None:
            raise ConfigError(problem, file=isolation.file, line=isolation.line,
                              field=isolation.field)

    def batch_wait(self, node: Node, field: str) -> float:
        wait = self.duration(node, field, positive=False)
        if wait > MAX_BATCH_WAIT:
            raise self.error(f"must be at most {format_duration(MAX_BATCH_WAIT)}, got "
                             f"{format_duration(wait)}: a batch waits this long for more keys "
                             "before its handler runs", node, field)
        return wait

    def rule_name(self, entries: Entries, node: Node, prefix: str,
                  seen: dict[str, int]) -> str:
        field = f"{prefix}.name"
        name_node = self.require(entries, "name", node, prefix, "the rule")
        name = self.identifier(name_node, field, "rule name")
        if name in seen:
            raise self.error(f"duplicate rule name {shown(name)} (first used on line "
                             f"{seen[name]}); rule names must be unique", name_node, field)
        seen[name] = line_of(name_node)
        return name

    def rule_pattern(self, entries: Entries, node: Node, index: int, name: str) -> KeyPattern:
        match_node = self.require(entries, "match", node, f"rules[{index}]", "the rule")
        source = self.string(match_node, f"rules[{index}].match", "match")
        try:
            pattern = KeyPattern.compile(source)
        except ValueError as exc:
            raise self.error(str(exc), match_node, f"rules[{index}].match") from None
        self.matches.append(RuleMatch(index, name, pattern, line_of(match_node)))
        return pattern

    def rate(self, node: Node, field: str) -> RateLimit:
        """``N/s``, ``N/m`` or ``N/h``: refresh starts per second, minute or hour."""
        raw = self.value(node, field)
        found = _RATE_RE.fullmatch(raw) if isinstance(raw, str) else None
        if found is None or found.group(2) not in RATE_UNITS:
            raise self.error(f"rate must be starts per second, minute or hour, written "
                             f"like 100/s, 30/m or 500/h, got {shown(raw)}", node, field)
        count = int(found.group(1))
        if not 1 <= count <= MAX_RATE:
            raise self.error(f"rate must allow from 1 to {MAX_RATE} starts per period, "
                             f"got {count}", node, field)
        return RateLimit(count=count, per=RATE_UNITS[found.group(2)])

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
        line = culprit.line if culprit.line is not None else line_of(node)
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
            raise self.error(f"handler {shown(ref)} must have the form 'module:function' "
                             f"(e.g. myapp.stats:refresh_user), or be an http: block",
                             handler_node, field)
        spec = HandlerImport(ref=ref, file=self.file, line=line_of(handler_node), field=field,
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
            self.secrets.append(RuleSecret(*rule, secret_env, line_of(entries["secret_env"][1])))
        self.settle(before)
        if url is None:
            raise Abandon
        return HttpHandler(url=url, method=method, timeout=timeout, secret_env=secret_env)

    def http_url(self, entries: Entries, node: Node, prefix: str,
                 pattern: KeyPattern | None) -> str:
        return self.url(self.require(entries, "url", node, prefix, "the http handler"),
                        f"{prefix}.url", pattern)

    def url(self, node: Node, field: str, pattern: KeyPattern | None) -> str:
        url = self.string(node, field, "url")
        for name in URL_FIELD_RE.findall(url):
            if pattern is not None and name not in pattern.names:
                known = ", ".join(f"{{{n}}}" for n in pattern.names) or "none"
                raise self.error(f"url uses {{{name}}}, which is not a capture of the rule's "
                                 f"pattern {pattern.source!r} (its captures: {known})",
                                 node, field)
        bare = URL_FIELD_RE.sub("x", url)
        if "{" in bare or "}" in bare:
            raise self.error(f"unbalanced brace in url {shown(redact(url))}; "
                             "use {name} for a capture", node, field)
        parts = urlsplit(bare)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise self.error(f"url {shown(redact(url))} must be an absolute http:// or "
                             "https:// URL", node, field)
        outside = _captures_outside_path(url)
        if outside:
            name, where = outside
            raise self.error(f"url {shown(redact(url))} uses {{{name}}} in its {where}: a "
                             "capture may only fill in the path (after the host), so that "
                             "no key can send the request to another server", node, field)
        return url

    def method(self, node: Node, field: str) -> str:
        raw = self.string(node, field, "method")
        if raw.upper() not in HTTP_METHODS:
            raise self.error(f"method {shown(raw)} is not allowed; use one of "
                             f"{', '.join(HTTP_METHODS)}", node, field)
        return raw.upper()

    def env_name(self, node: Node, field: str) -> str:
        raw = self.string(node, field, "secret_env")
        if _ENV_RE.fullmatch(raw) is None:
            raise self.error(f"secret_env {shown(raw)} must be the name of an environment "
                             f"variable (letters, digits and '_')", node, field)
        return raw
