"""Rules in code: ``Rules(...)`` and ``Rule(...)`` build the same ``Config`` a rules file
does, for apps that configure in Python.

The keyword arguments are the rules file's fields, by the same names. They become the
nodes the YAML reader would make, each marked with the Python call that gave it, and go
through the same schema (``coalescer.config.schema``): the same checks and messages, each
error naming the ``Rule(...)`` or ``Rules(...)`` call's file and line instead of a line of
a rules file. A handler is a function (``def`` or ``async def``), or a ``module:function``
path imported (like a rules file's) only by a process that runs handlers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

from yaml.error import Mark
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from coalescer.config.handler_import import is_async, signature_problem
from coalescer.config.model import Handler
from coalescer.config.model import Rule as RuleModel
from coalescer.config.namespace_env import namespace_override
from coalescer.config.rules import Config, _config
from coalescer.config.schema import DEFAULT_NAMESPACE, RulesSchema, Settings, _Setting
from coalescer.config.yaml_reader import Entries, kind, shown
from coalescer.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Rule", "Rules"]

Duration = str | float | timedelta
"""A duration: ``"300ms"``, ``"2s"``, ``"5m"``, ``"1h"``, a number of seconds, or a
``datetime.timedelta``."""


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()  # a field not given: the schema's default applies


class Rule:
    """One rule, as a rules file's ``rules:`` entry: the same fields, as keyword
    arguments. Checked when the ``Rules(...)`` holding it is built; its errors name the
    file and line of this call."""

    __slots__ = ("fields", "file", "line")

    def __init__(self, *, name: str, match: str,  # noqa: PLR0913  (the file's fields)
                 handler: Callable[..., object] | str | Mapping[str, Any],
                 window: Duration = _UNSET, max_wait: Duration = _UNSET,
                 absorb: Duration = _UNSET, timeout: Duration = _UNSET,
                 concurrency: int = _UNSET, retry: Mapping[str, Any] = _UNSET,
                 rate: str = _UNSET, batch: Mapping[str, Any] = _UNSET,
                 items: Mapping[str, Any] = _UNSET, isolation: str = _UNSET,
                 edge: str = _UNSET, fair: Mapping[str, Any] = _UNSET,
                 priority: Duration = _UNSET, **unknown: Any) -> None:
        self.file, self.line = _call_site()
        given = {"name": name, "match": match, "handler": handler, "window": window,
                 "max_wait": max_wait, "absorb": absorb, "timeout": timeout,
                 "concurrency": concurrency, "retry": retry, "rate": rate, "batch": batch,
                 "items": items, "isolation": isolation, "edge": edge,
                 "fair": fair, "priority": priority}
        self.fields: dict[str, Any] = _given(given) | unknown

    def __repr__(self) -> str:
        return f"Rule(name={self.fields.get('name')!r}, match={self.fields.get('match')!r})"


class Rules:
    """A whole rules file's worth of settings and rules, as keyword arguments by the
    file's names; ``rules`` is a list of ``Rule(...)`` (or of mappings, as in the file).

    Built and checked at once: a ConfigError carries every problem, each with the file
    and line of the ``Rules(...)`` or ``Rule(...)`` call at fault and the field as a
    rules file names it (``rules[0].window``). ``config`` is the ``Config``.

    ``$COALESCER_NAMESPACE`` replaces ``namespace`` as it does a rules file's, read each
    time ``config`` is (when a coalescer is built on these rules, as a rules file is read
    then), so rules built at import follow a variable set later (a test's).
    """

    __slots__ = ("_built", "_namespace", "file", "line")

    def __init__(self, *, rules: Sequence[Rule | Mapping[str, Any]],  # noqa: PLR0913
                 namespace: str = _UNSET, shards: int = _UNSET,
                 leader_lease: Duration = _UNSET, claim_lease: Duration = _UNSET,
                 history: int = _UNSET, durability: Mapping[str, Any] = _UNSET,
                 limits: Mapping[str, Any] = _UNSET, defaults: Mapping[str, Any] = _UNSET,
                 sources: Sequence[Mapping[str, Any]] = _UNSET, **unknown: Any) -> None:
        self.file, self.line = _call_site()
        given = {"namespace": namespace, "shards": shards, "leader_lease": leader_lease,
                 "claim_lease": claim_lease, "history": history, "durability": durability,
                 "limits": limits, "defaults": defaults, "rules": rules, "sources": sources}
        self._built = build(_given(given) | unknown, self.file, self.line)
        self._namespace = namespace if namespace is not _UNSET else DEFAULT_NAMESPACE

    @property
    def config(self) -> Config:
        """The rules' Config, its namespace ``$COALESCER_NAMESPACE``'s if set now."""
        built = self._built
        namespace = namespace_override(built.source) or self._namespace
        return built if namespace == built.namespace else replace(built, namespace=namespace)

    def __repr__(self) -> str:
        names = ", ".join(rule.name for rule in self.config.rules)
        return f"<Rules at {self.file}:{self.line}: {names}>"


def rules_config(rules: Rules | Config) -> Config:
    """The ``Config`` of ``rules`` (built in code, or loaded from a file)."""
    return rules.config if isinstance(rules, Rules) else rules


def build(fields: Mapping[str, Any], file: str, line: int) -> Config:
    """The Config of a rules document given as Python values, called at file:line."""
    schema = CodeSchema(file)
    document = schema.read(to_node(fields, _mark(file, line)))
    schema.file = f"<Rules(...) at {file}:{line}>"  # the config's source: not a file
    config = _config(schema, document)
    if config is not None:
        config = replace(config, built_in=file)
    problems = schema.outcome()
    if problems is not None or config is None:
        raise problems or ConfigError("cannot be loaded", file=schema.file)
    return config


def _call_site() -> tuple[str, int]:
    """The file and line of the call to the constructor calling this."""
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno


def _given(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not _UNSET}


def _mark(file: str, line: int) -> Mark:
    return Mark(file, 0, line - 1, 0, None, 0)


# -- Python values as the reader's nodes --


class _FromPython:
    """A node made from a Python value (``py``), not read from YAML text."""

    py: object


class _Scalar(ScalarNode, _FromPython):
    def __init__(self, value: object, mark: Mark) -> None:
        text = value if isinstance(value, str) else repr(value)
        super().__init__(_tag(value), text, mark, mark)
        self.py = value


class _Mapping(MappingNode, _FromPython):
    def __init__(self, value: Mapping[Any, Any], mark: Mark) -> None:
        pairs = [(to_node(key, mark), to_node(item, mark)) for key, item in value.items()]
        super().__init__("tag:yaml.org,2002:map", pairs, mark, mark)
        self.py = dict(value)


class _Sequence(SequenceNode, _FromPython):
    def __init__(self, value: Sequence[Any], mark: Mark) -> None:
        super().__init__("tag:yaml.org,2002:seq", [to_node(item, mark) for item in value],
                         mark, mark)
        self.py = list(value)


_TAGS = {str: "str", bool: "bool", int: "int", float: "float", type(None): "null"}


def _tag(value: object) -> str:
    return "tag:yaml.org,2002:" + _TAGS.get(type(value), "python")


def to_node(value: object, mark: Mark) -> Node:
    """The node of ``value``: a ``Rule`` is marked with its own call, the rest with
    ``mark``; a timedelta becomes its seconds."""
    if isinstance(value, Rule):
        return _Mapping(value.fields, _mark(value.file, value.line))
    if isinstance(value, timedelta):
        return _Scalar(value.total_seconds(), mark)
    if isinstance(value, Mapping):
        return _Mapping(value, mark)
    if isinstance(value, list | tuple):
        return _Sequence(value, mark)
    return _Scalar(value, mark)


# -- the schema, reading those nodes --

_WHAT = {"the top level": "Rules(...)", "the rules file": "Rules(...)", "a rule": "Rule(...)",
         "the rule": "Rule(...)"}


class CodeSchema(RulesSchema):
    """The rules schema reading nodes made from Python values: errors name the file of
    the call each node came from; a handler may be a function."""

    def __init__(self, file: str) -> None:
        super().__init__(file, base_dir=None, import_handlers=False)
        self.top_file = file

    def value(self, node: Node, field: str) -> Any:
        return node.py if isinstance(node, _FromPython) else super().value(node, field)

    def unknown(self, name: str, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> ConfigError:
        return super().unknown(name, node, prefix, allowed, _WHAT.get(what, what))

    def require(self, entries: Entries, name: str, node: Node, prefix: str,
                what: str) -> Node:
        return super().require(entries, name, node, prefix, _WHAT.get(what, what))

    def rule(self, node: Node, index: int, defaults: Settings,
             seen: dict[str, int]) -> RuleModel:
        """The rule, its errors in the file of its ``Rule(...)`` call."""
        self.file = str(node.start_mark.name)
        try:
            rule = super().rule(node, index, defaults, seen)
            if rule.isolation is not None and callable(rule.handler):
                return self.importable(rule)
            return rule
        finally:
            self.file = self.top_file

    def blame(self, first: _Setting, second: _Setting, node: Node, message: str) -> None:
        if max(first.level, second.level) == 1:  # a ``defaults`` setting: Rules(...)'s
            rule_file, self.file = self.file, self.top_file
            try:
                super().blame(first, second, node, message)
            finally:
                self.file = rule_file
            return
        super().blame(first, second, node, message)

    def rule_handler(self, entries: Entries, node: Node, index: int, name: str,
                     pattern: Any) -> tuple[Handler, str]:
        found = entries.get("handler")
        raw = self.value(found[1], "handler") if found is not None else None
        if found is None or isinstance(found[1], MappingNode) or isinstance(raw, str):
            return super().rule_handler(entries, node, index, name, pattern)
        field = f"rules[{index}].handler"
        if not callable(raw):
            raise self.error(f"handler must be a function (def or async def) or a "
                             f"'module:function' path, got {kind(raw)} ({shown(raw)})",
                             found[1], field)
        ref = handler_ref(raw)
        problem = signature_problem(raw)
        if problem is not None:
            raise self.error(f"handler {ref} {problem}", found[1], field)
        return raw, ref

    def importable(self, rule: RuleModel) -> RuleModel:
        """A child process of ``isolation: process`` imports the handler by its path: the
        function must be found again by ``module:function``. Without an isolation field,
        a plain function that cannot be runs on threads (a warning says so)."""
        isolation = rule.isolation
        if isolation is None or found_by_ref(rule.handler, rule.handler_ref):
            return rule
        if not isolation.explicit:
            if callable(rule.handler) and not is_async(rule.handler):
                log.warning("rule %s: handler %s cannot be imported by name in a child "
                            "process (a lambda, a nested function, or one of __main__): it "
                            "runs on the node's threads, where a run cannot be stopped; "
                            "define it at the top level of a module, or say isolation: "
                            "thread", rule.name, rule.handler_ref)
            return replace(rule, isolation=None)
        raise ConfigError(
            f"isolation: process imports the handler by name in each child process, and "
            f"{rule.handler_ref} cannot be imported by name (a lambda, a nested function, "
            "or one of __main__): define it at the top level of a module, or give its "
            "'module:function' path", file=isolation.file, line=isolation.line,
            field=isolation.field)


def handler_ref(fn: Callable[..., object]) -> str:
    """``module:qualified.name`` of a function (its repr when it has neither)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return repr(fn)
    return f"{module}:{qualname}"


def found_by_ref(fn: object, ref: str) -> bool:
    """Whether ``ref`` (``module:name``) names ``fn`` in a module a child can import."""
    module_name, _, path = ref.partition(":")
    target: object = sys.modules.get(module_name)
    if module_name in ("", "__main__") or target is None:
        return False
    for part in path.split("."):
        target = getattr(target, part, None)
    return target is fn
