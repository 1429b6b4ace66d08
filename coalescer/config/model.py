"""One rule of a rules file, resolved: its pattern, settings, retry policy and handler
(a Python callable, or an ``http:`` webhook). ``coalescer.config.rules`` holds the whole
file's ``Config``; ``coalescer.config.schema`` builds both from the YAML."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from coalescer.common.redact import redact
from coalescer.config.durations import format_duration
from coalescer.config.fair import FairPolicy, fair_lines
from coalescer.config.handler_import import HandlerImport, is_async
from coalescer.config.patterns import KeyPattern

URL_FIELD_RE = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently a failing refresh is tried again."""

    attempts: int
    backoff: float
    max_backoff: float

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), jittered to 50-100%."""
        exponent = min(max(attempt, 1) - 1, 1023)
        base = min(self.max_backoff, self.backoff * 2.0**exponent)
        jitter = rng.uniform(0.5, 1.0) if rng is not None else random.uniform(0.5, 1.0)
        return base * jitter


def quote_capture(value: str) -> str:
    """``value`` percent-encoded so that it stays inside one path segment: every
    character but letters, digits, ``-``, ``_`` and ``~`` is encoded, dots too, so a
    capture of ``.`` or ``..`` can never become a dot segment that moves the path."""
    return quote(value, safe="").replace(".", "%2E")


@dataclass(frozen=True, kw_only=True, slots=True)
class RateLimit:
    """A rule's ``rate:``: at most ``count`` refresh starts per ``per`` seconds, cluster-wide.

    Starts are paced by a token bucket that holds ``burst`` tokens: after a quiet
    spell, up to a tenth of a second's worth of starts (at least one) may go at once.
    """

    count: int
    per: float  # seconds: 1 (``/s``), 60 (``/m``) or 3600 (``/h``)

    @property
    def per_second(self) -> float:
        return self.count / self.per

    @property
    def burst(self) -> int:
        """The bucket's size: a tenth of a second's starts, at least one."""
        return max(1, math.ceil(self.per_second * BURST_SECONDS))

    def __str__(self) -> str:
        return f"{self.count}/{_RATE_UNIT_NAMES[self.per]}"


BURST_SECONDS = 0.1
_RATE_UNIT_NAMES = {1.0: "s", 60.0: "m", 3600.0: "h"}
RATE_UNITS = {name: per for per, name in _RATE_UNIT_NAMES.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPolicy:
    """A batch rule's handler gets a list of claims: up to ``max`` due keys at once,
    waiting at most ``wait`` seconds for a fuller list once the first key is claimed."""

    max: int
    wait: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemsPolicy:
    """A rule's ``items:``: a touch may carry an item, and a refresh gets the distinct
    items touched since its key's previous claim, at most ``max`` of them (past it, the
    claim says the items overflowed)."""

    max: int


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpHandler:
    """The ``http:`` handler form: a webhook called with the claim as its JSON body."""

    url: str
    method: str = "POST"
    timeout: float | None = None
    secret_env: str | None = None

    def url_for(self, params: Mapping[str, str]) -> str:
        """The url with every ``{name}`` replaced by the URL-quoted captured segment."""
        return URL_FIELD_RE.sub(lambda m: quote_capture(params[m.group(1)]), self.url)

    def __str__(self) -> str:
        return f"{self.method} {redact(self.url)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessIsolation:
    """A rule's ``isolation: process`` (the default for a plain function): its handler
    runs in the node's child processes, killed at the timeout, when the claim is lost
    and at the end of the shutdown grace. Said explicitly, only for a Python handler
    that is not ``async def``; by default, it applies to plain functions only."""

    base_dir: Path | None  # the folder a child imports the handler from (the rules file's)
    file: str  # where the rules file says so (by default: the rule's own line)
    line: int
    field: str
    explicit: bool = True  # False: the rule has no isolation field

    def problem(self, handler: object) -> str | None:
        """Why ``handler`` cannot run in a child process, or None when it can (or when
        the rule did not ask: the default leaves other handlers as they are)."""
        if not self.explicit:
            return None
        if isinstance(handler, HttpHandler):
            return ("isolation: process runs a Python handler in a child process; an http "
                    "handler has nothing to isolate: remove isolation (or use thread)")
        if callable(handler) and is_async(handler):
            return ("isolation: process is for a plain (sync) function handler; this one is "
                    "async def and runs on the node's event loop: make it a plain function, "
                    "or remove isolation")
        return None


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
    rate: RateLimit | None = None  # None: starts are not throttled
    batch: BatchPolicy | None = None  # None: one handler call per key
    items: ItemsPolicy | None = None  # None: touches of its keys carry no item
    isolation: ProcessIsolation | None = None  # None: a plain handler runs on threads
    edge: str = "trailing"  # or "leading" (config/edges.py)
    fair: FairPolicy | None = None  # None: due keys claimed in due order (config/fair.py)
    # seconds: among due keys, claimed as if due this much earlier; None: not given (a
    # touch's own priority is then refused unless the rule is fair)
    priority: float | None = None

    @property
    def leading(self) -> bool:
        """Whether the first touch of a quiet key refreshes it at once (``edge: leading``)."""
        return self.edge == "leading"

    @property
    def in_child_process(self) -> bool:
        """Whether the handler (imported, a plain function) runs in a child process."""
        handler = self.handler
        return (self.isolation is not None and callable(handler)
                and not is_async(handler))

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
        if self.rate is not None:
            lines.append(f"  rate: {self.rate} (refresh starts, cluster-wide; "
                         f"bursts of up to {self.rate.burst})")
        if self.batch is not None:
            lines.append(f"  batch: max {self.batch.max}, wait {format_duration(self.batch.wait)}"
                         " (concurrency counts batches)")
        if self.items is not None:
            lines.append(f"  items: max {self.items.max} (claim.items; past it, "
                         "claim.items_overflowed)")
        lines += fair_lines(self.fair, self.priority)
        if self.leading:
            lines.append("  edge: leading (the first touch of a quiet key refreshes it at "
                         "once; touches after that start one more refresh a window after "
                         "the last)")
        if self.isolation is not None and (self.isolation.explicit or self.in_child_process):
            lines.append("  isolation: process (in the node's child processes, killed at "
                         "the timeout and when its claim is lost)")
        if isinstance(self.handler, HttpHandler):
            lines.append("  http: " + _describe_http(self.handler, self.timeout))
        return "\n".join(lines)


def _describe_http(handler: HttpHandler, rule_timeout: float) -> str:
    timeout = handler.timeout if handler.timeout is not None else rule_timeout
    signed = f"signed with ${handler.secret_env}" if handler.secret_env else "unsigned"
    return f"request timeout {format_duration(timeout)}, {signed}"
