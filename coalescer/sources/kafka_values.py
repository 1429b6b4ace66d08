"""What a Kafka message touches: the key (and item) its value's fields fill in, or why not.

A message's value must be a JSON object; a template's ``{field}`` takes the field of that
name, a string or a number (a whole number is written without a fraction). What makes a
message rejected (too long, not JSON, nested deeper than 32 levels, a field missing or
of another kind, a ``:``, a key that cannot be stored or matches no rule, ...) is
docs/sources.md's "A bad message never blocks a partition"; JSON that deep would cost
a deep stack to decode, so its depth is checked first. A message whose reading raises
anything else is rejected too (a poison message), logged once a minute per kind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coalescer.common.json_depth import TooDeep, loads_bounded
from coalescer.common.log_once import LogOnce
from coalescer.common.traceparent import read_traceparent
from coalescer.config.kafka_source import KafkaSource
from coalescer.config.rules import Config
from coalescer.config.templates import KeyTemplate, TemplateOverflow
from coalescer.errors import UnknownKeyError, shown_key
from coalescer.sources.times import Timed, time_of
from coalescer.store.keycheck import item_problem, key_problem

MAX_VALUE_BYTES = 1 << 20  # a longer message value is rejected unread
Where = tuple[str, int, int, str]  # a rejected message: topic, partition, offset, why
log = logging.getLogger(__name__)


class Rejected(ValueError):
    """Why a message cannot become a touch."""


@dataclass(kw_only=True, slots=True)
class Touches:
    """The touches of a run of messages: plain keys, (key, item) pairs, touches with a
    time of their own (a source with ``at:``/``delay:``), and each rejected message as
    (topic, partition, offset, why)."""

    keys: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    timed: list[Timed] = field(default_factory=list)  # with at:/delay:, every touch
    rejected: list[Where] = field(default_factory=list)
    # where each of ``keys`` and ``timed`` came from (topic, partition, offset), until
    # their rules were checked (``MessageReader.screen``)
    keys_from: list[tuple[str, int, int]] = field(default_factory=list)
    timed_from: list[tuple[str, int, int]] = field(default_factory=list)
    pairs_from: list[tuple[str, int, int]] = field(default_factory=list)  # kept by screen
    # (key, W3C traceparent) of the messages whose producer sent its trace context in a
    # ``traceparent`` header, for the refresh to link to (read with tracing on only)
    traced: list[tuple[str, str]] = field(default_factory=list)


def _text(name: str, value: Any, *, segment: bool) -> str:
    """A field's value as template text; Rejected when it cannot be."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool) or not isinstance(value, int | float):
        kind = "null" if value is None else type(value).__name__
        raise Rejected(f"field {name!r} is {kind}, not a string or a number")
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = str(value)
    if segment and ":" in text:
        raise Rejected(f"field {name!r} holds ':' (at index {text.index(':')}): a field "
                       "fills at most one segment of a key")
    return text


def _fill(template: KeyTemplate, fields: dict[str, Any], *, segment: bool) -> str:
    values: dict[str, str] = {}
    for name in template.fields:
        if name not in fields:
            raise Rejected(f"its value has no field {name!r}")
        values[name] = _text(name, fields[name], segment=segment)
    try:
        return template.fill(values)
    except TemplateOverflow as exc:
        raise Rejected(str(exc)) from None


def _trace_of(message: Any, key: str, out: list[tuple[str, str]]) -> None:
    """Add (key, traceparent) when ``message`` has a ``traceparent`` header."""
    for name, value in message.headers or ():
        if name == "traceparent" and isinstance(value, bytes):
            text = read_traceparent(value)  # None: too long to be one, left out
            if text is not None:
                out.append((key, text))
            return


class MessageReader:
    """Turns the values of one source's messages into touches."""

    def __init__(self, source: KafkaSource, config: Config) -> None:
        self._source = source
        self._config = config
        self._known: dict[str, bool] = {}  # key -> its rule takes items (keys seen lately)
        self._poisons = LogOnce(log)  # messages whose reading raised: a line a minute a kind

    def touches(self, messages: Iterable[Any], *, traced: bool = False) -> Touches:
        """The touches of ``messages`` (aiokafka ``ConsumerRecord``s), in order. A plain
        or timed touch's key is not matched to a rule here: the touch checks it, and
        ``screen`` rejects the messages whose key no rule takes only when it refused."""
        out = Touches()
        for message in messages:
            where = (message.topic, message.partition, message.offset)
            try:
                key, item, spec = self.touch_of(message.value)
            except Rejected as exc:
                out.rejected.append((*where, str(exc)))
                continue
            except Exception as exc:  # a poison message: rejected, never read again
                out.rejected.append((*where, self._poison(exc, where)))
                continue
            if traced:
                _trace_of(message, key, out.traced)
            if spec is not None:
                out.timed.append((key, item, spec))
                out.timed_from.append(where)
            elif item is None:
                out.keys.append(key)
                out.keys_from.append(where)
            else:
                out.pairs.append((key, item))
                out.pairs_from.append(where)
        return out

    def _poison(self, exc: Exception, where: tuple[str, int, int]) -> str:
        """Why a message whose reading raised ``exc`` is rejected; logged once a minute
        per kind of error (the message is rejected and committed like any other)."""
        why = f"it could not be read ({type(exc).__name__}: {str(exc)[:200]})"
        self._poisons.warning(type(exc).__name__,
                              "source %s: message %s/%d@%d raised %s while being read: %s",
                              self._source.name, *where, type(exc).__name__, str(exc)[:200])
        return why

    def screen(self, touches: Touches) -> Touches:
        """``touches`` without the plain and timed ones whose key no rule takes or Redis
        cannot store: those messages rejected (and their trace contexts left out)."""
        out = Touches(pairs=touches.pairs, pairs_from=touches.pairs_from,
                      rejected=list(touches.rejected))
        for key, where in zip(touches.keys, touches.keys_from, strict=True):
            try:
                self._rule_of(key)
            except Rejected as exc:
                out.rejected.append((*where, str(exc)))
                continue
            out.keys.append(key)
        for timed, where in zip(touches.timed, touches.timed_from, strict=True):
            try:
                self._rule_of(timed[0])
            except Rejected as exc:
                out.rejected.append((*where, str(exc)))
                continue
            out.timed.append(timed)
        kept = {*out.keys, *(key for key, _, _ in out.timed), *(key for key, _ in out.pairs)}
        out.traced = [(key, tp) for key, tp in touches.traced if key in kept]
        return out

    def touch_of(self, value: bytes | None) -> tuple[str, str | None, str | None]:
        """The key, item and time (wire form) one message's value touches; Rejected says
        why not (a key without an item is matched to its rule by its touch)."""
        fields = _object(value)
        key = _fill(self._source.key, fields, segment=True)
        item = None
        if self._source.item is not None:
            takes_items = self._rule_of(key)
            item = _fill(self._source.item, fields, segment=False)
            problem = item_problem(item)
            if problem is None and not takes_items:
                problem = f"the rule of key {shown_key(key)} takes no items"
            if problem is not None:
                raise Rejected(f"item {shown_key(item)} cannot be touched: {problem}")
        spec, why = time_of(self._source, key, lambda name: _field(fields, name),
                            self._config.limits.max_schedule_ahead)
        if why:
            raise Rejected(why)
        return key, item, spec

    def _rule_of(self, key: str) -> bool:
        """Whether the rule of ``key`` takes items; Rejected when none can take the key."""
        found = self._known.get(key)
        if found is not None:
            return found
        problem = key_problem(key)
        if problem is not None:
            raise Rejected(f"key {shown_key(key)} cannot be stored: {problem}")
        try:
            rule = self._config.rule_for(key)
        except UnknownKeyError:
            raise Rejected(f"no rule matches key {shown_key(key)}") from None
        if len(self._known) >= 10_000:
            self._known.clear()
        self._known[key] = rule.items is not None
        return rule.items is not None


def _field(fields: dict[str, Any], name: str) -> str | None:
    """A field as the text an ``at:``/``delay:`` template takes; None when missing."""
    if name not in fields:
        return None
    return _text(name, fields[name], segment=False)


def _object(value: bytes | None) -> dict[str, Any]:
    if value is None:
        raise Rejected("it has no value (a tombstone)")
    if len(value) > MAX_VALUE_BYTES:
        raise Rejected(f"its value is {len(value)} bytes long, over the limit of "
                       f"{MAX_VALUE_BYTES}")
    try:
        fields = loads_bounded(value)
    except TooDeep as exc:
        raise Rejected(f"its value is JSON nested too deeply, {exc}") from None
    except (UnicodeDecodeError, ValueError):
        raise Rejected("its value is not JSON") from None
    if not isinstance(fields, dict):
        raise Rejected(f"its value is JSON {type(fields).__name__}, not an object")
    return fields
