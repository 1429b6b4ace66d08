"""A careful YAML reader for configuration files: the file read within its size limit,
composed into nodes that keep their line, aliases refused past a size or depth limit, and
typed field getters whose errors name the file, the line and the field.

``YamlReader`` records errors as it goes (``attempt``) so that one reading finds every
problem; a schema (``coalescer.config.schema``, ``coalescer.config.sources``) calls its
getters on the nodes it walks.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from coalescer.config.durations import ACCEPTED as DURATIONS_ACCEPTED
from coalescer.config.durations import NegativeDurationError, parse_duration
from coalescer.errors import ConfigError

_P = ParamSpec("_P")
_T = TypeVar("_T")

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
MERGE_TAG = "tag:yaml.org,2002:merge"
MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 50
MAX_VALUES = 250_000


def read_text(source: str) -> str:
    """The file's text: at most MAX_FILE_BYTES of UTF-8, or a one-line ConfigError."""
    try:
        with open(source, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("rules file not found (give another with --rules PATH)",
                          file=source) from None
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


def shown(value: object) -> str:
    """A short repr of a value from the file, for error messages."""
    return _SHORT_REPR.repr(value)


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = 80
_SHORT_REPR.maxother = 80


Entries = dict[str, tuple[Node, Node]]  # field name: (its key node, its value node)


def join(prefix: str, name: str) -> str:
    """The dotted field name of ``name`` inside ``prefix`` (e.g. ``rules[0].window``)."""
    return f"{prefix}.{name}" if prefix else name


def line_of(node: Node) -> int:
    """The 1-based line ``node`` starts on."""
    return int(node.start_mark.line) + 1


def kind(value: object) -> str:
    """What sort of value ``value`` is, in words ("a list"), for error messages."""
    if value is None:
        return "nothing (null)"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping"}
    return names.get(type(value), type(value).__name__)


class _TooDeep(ComposerError):
    """Raised by the composer for a value nested deeper than MAX_DEPTH."""


class _PyParser(Reader, Scanner, Parser):
    """pyyaml's own parser, where the build lacks libyaml."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)


try:
    from yaml.cyaml import CParser as _CParser  # type: ignore[attr-defined]
    _Parser: Any = _CParser
except ImportError:  # pragma: no cover - a pyyaml without libyaml
    _Parser = _PyParser


class _DepthLimitedLoader(Composer, _Parser, SafeConstructor, Resolver):  # type: ignore[misc]
    """A safe loader whose composer refuses values nested deeper than MAX_DEPTH (instead
    of running out of stack). libyaml's parser makes the events when the pyyaml build
    has it (five times faster on a long file); the composer is Python's, so the depth
    limit holds before any nesting is built."""

    _depth = 0

    def __init__(self, stream: str) -> None:
        _Parser.__init__(self, stream)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self._depth >= MAX_DEPTH:
            raise _TooDeep(None, None, f"values are nested more than {MAX_DEPTH} deep",
                           self.peek_event().start_mark)
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
        return ConfigError(message, file=self.file, line=line_of(node))

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


class Abandon(Exception):
    """Errors of this part are recorded already: skip what depends on it."""


class YamlReader:
    """Reads the nodes of one file so every error carries its file, line and field. It
    records an error and goes on to find the others (``attempt``); a schema skips only
    what depends on the bad part (``settle``, ``Abandon``)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.errors: list[ConfigError] = []

    def error(self, message: str, node: Node | None = None,
              field: str | None = None) -> ConfigError:
        line = line_of(node) if node is not None else None
        return ConfigError(message, file=self.file, line=line, field=field)

    def attempt(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T | None:
        """``fn(...)``, or None once the errors it raised are recorded."""
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            self.errors.extend(exc.errors)
        except Abandon:
            pass
        return None

    def settle(self, before: int) -> None:
        """Abandon the part being read if it recorded errors (since ``before`` of them)."""
        if len(self.errors) > before:
            raise Abandon

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
            if "maximum nesting depth" in problem:  # libyaml's own limit, met first
                raise ConfigError(f"values are nested more than {MAX_DEPTH} deep; a rules "
                                  "file needs only a few levels", file=self.file,
                                  line=line) from None
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
        constructor = SafeConstructor()  # no reader or parser: the node is composed
        try:
            return constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            problem = _yaml_problem(exc)[0] if isinstance(exc, yaml.MarkedYAMLError) else exc
            raise self.error(f"cannot read value: {problem}", node, field) from None

    def mapping(self, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> Entries:
        """The fields of a mapping; unknown or repeated fields are recorded and left out."""
        if not isinstance(node, MappingNode):
            got = kind(self.value(node, prefix))
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
            if key_node.tag == MERGE_TAG:
                continue
            name = self.attempt(self.key_name, key_node, prefix)
            if name is None:
                continue
            if name in seen:
                self.errors.append(self.error(f"field {shown(name)} is given twice; give it "
                                              "once", key_node, join(prefix, name)))
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
        got = node.value if isinstance(node, ScalarNode) else kind(self.value(node, prefix))
        raise self.error(f"field names must be plain strings, got {shown(got)}", node,
                         prefix or None)

    def unknown(self, name: str, node: Node, prefix: str, allowed: tuple[str, ...],
                what: str) -> ConfigError:
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return self.error(f"unknown field {shown(name)} in {what}{hint}; allowed: "
                          f"{', '.join(allowed)}", node, join(prefix, name))

    def require(self, entries: Entries, name: str, node: Node, prefix: str,
                what: str) -> Node:
        if name not in entries:
            raise self.error(f"{what} is missing the required field {shown(name)}", node,
                             join(prefix, name))
        return entries[name][1]

    def optional(self, entries: Entries, prefix: str, name: str,
                 parse: Callable[[Node, str], _T], default: _T) -> _T:
        """The field ``name`` read by ``parse``; ``default`` when absent or bad (recorded)."""
        if name not in entries:
            return default
        found = self.attempt(parse, entries[name][1], join(prefix, name))
        return default if found is None else found

    # -- typed values --

    def duration(self, node: Node, field: str, *, positive: bool) -> float:
        raw = self.value(node, field)
        try:
            seconds = parse_duration(raw)
        except NegativeDurationError:
            raise self.error(f"negative duration {shown(raw)}: a duration is never below 0; "
                             f"expected {DURATIONS_ACCEPTED}", node, field) from None
        except ValueError:
            raise self.error(f"bad duration {shown(raw)}: expected {DURATIONS_ACCEPTED}",
                             node, field) from None
        if positive and seconds <= 0:
            raise self.error(f"must be longer than 0, got {shown(raw)}; expected "
                             f"{DURATIONS_ACCEPTED}, above 0", node, field)
        return seconds

    def positive_duration(self, node: Node, field: str) -> float:
        return self.duration(node, field, positive=True)

    def positive_int(self, node: Node, field: str, limit: int | None = None) -> int:
        raw = self.value(node, field)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise self.error(f"must be a positive whole number (1, 2, ...), got {shown(raw)}",
                             node, field)
        if limit is not None and raw > limit:
            raise self.error(f"must be at most {limit}, got {raw}", node, field)
        return raw

    def string(self, node: Node, field: str, what: str) -> str:
        raw = self.value(node, field)
        if not isinstance(raw, str) or not raw:
            raise self.error(f"{what} must be a non-empty string, got {kind(raw)} "
                             f"({shown(raw)})", node, field)
        return raw

    def identifier(self, node: Node, field: str, what: str) -> str:
        raw = self.string(node, field, what)
        if NAME_RE.fullmatch(raw) is None:
            raise self.error(f"{what} {shown(raw)} may only use letters, digits, '_', '.' and '-' "
                             f"(it becomes part of Redis keys)", node, field)
        return raw
