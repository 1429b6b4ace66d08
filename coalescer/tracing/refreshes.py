"""A node's refresh spans: each refresh is a CONSUMER span ``process {rule}`` that starts
a trace of its own and links to the spans of the touches it accounts for (kept beside
its key in Redis, store/lua/traces_put.lua); a retry also links to the failed try's span.
A batch handler call is one such span with a child per key (its links are the key's)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

from coalescer.tracing.bounds import GRACE_MS, KEEP
from coalescer.tracing.touches import span_context, traceparent

if TYPE_CHECKING:
    from coalescer.claim import Claim
    from coalescer.store.keys import KeySpace
    from coalescer.store.scripts import Scripts

log = logging.getLogger(__name__)
T = TypeVar("T")
SYSTEM = "coalescer"  # messaging.system
LINKS_WAIT = 1.0  # seconds a refresh waits at most for its links (Redis slow or away)


@dataclass(frozen=True, slots=True)
class Kept:
    """What Redis kept for one key's refresh: its touches' contexts (first and last few),
    how many were left out between, and the context of its failed try, if any."""

    touches: list[SpanContext]
    dropped: int
    tried: SpanContext | None

    @classmethod
    def decode(cls, value: str | None) -> Kept:
        if not value:
            return cls([], 0, None)
        dropped, first, last, tried = ([*value.split("|", 3), "", "", ""])[:4]
        found = [span_context(tp) for tp in f"{first},{last}".split(",") if tp]
        return cls([c for c in found if c is not None],
                   int(dropped) if dropped.isdigit() else 0, span_context(tried))

    def links(self) -> list[Link]:
        out = [Link(ctx) for ctx in self.touches]
        if self.tried is not None:
            out.append(Link(self.tried, {"coalescer.link": "retry"}))
        return out

    def count(self, touches: int) -> int:
        """The touches the refresh accounts for: those whose contexts came, or the
        burst's count in Redis when larger (touches made outside any span)."""
        return max(touches, len(self.touches) + self.dropped)


def _attributes(rule: str, claim: Claim, kept: Kept, touches: int) -> dict[str, str | int]:
    return {"messaging.system": SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": rule,
            "messaging.batch.message_count": kept.count(touches), "coalescer.key": claim.key,
            "coalescer.attempt": claim.attempt, "coalescer.token": claim.token,
            "coalescer.links_dropped": kept.dropped}


class RefreshTracer:
    """Starts the spans of this node's refreshes."""

    def __init__(self, scripts: Scripts, keyspace: KeySpace) -> None:
        self._scripts = scripts
        self._keyspace = keyspace
        self._tracer = trace.get_tracer("coalescer")
        self._writes: set[asyncio.Task[int]] = set()

    async def _kept(self, where: Sequence[tuple[int, str]]) -> list[Kept]:
        """What Redis kept for each (shard, key), taken from there."""
        by_shard: dict[int, list[str]] = defaultdict(list)
        for shard, key in where:
            by_shard[shard].append(key)
        found: dict[str, Kept] = {}
        for shard, keys in by_shard.items():
            try:
                values = await asyncio.wait_for(
                    self._scripts.traces_take(self._keyspace.shard(shard), keys), LINKS_WAIT)
            except Exception as exc:  # a refresh never fails, nor waits long, for its links
                log.debug("reading the trace links of %d keys failed: %r", len(keys), exc)
                values = [None] * len(keys)
            found.update(zip(keys, map(Kept.decode, values), strict=True))
        return [found[key] for _, key in where]

    def _root(self, rule: str, links: list[Link], attributes: dict[str, str | int]) -> Span:
        return self._tracer.start_span(f"process {rule}", context=otel_context.Context(),
                                       kind=SpanKind.CONSUMER, links=links,
                                       attributes=attributes)

    async def run_one(self, shard: int, rule: str, claim: Claim, touches: int,
                      call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call`` (the handler's) inside the refresh span of ``claim``."""
        where = [(shard, claim.key)]
        [kept] = await self._kept(where)
        span = self._root(rule, kept.links(), _attributes(rule, claim, kept, touches))
        return await self._within(span, [], where, call)

    async def run_batch(self, rule: str, batch: Sequence[tuple[int, Claim, int]],
                        call: Callable[[], Awaitable[T]],
                        failed: Callable[[T], Collection[str]]) -> T:
        """Run ``call`` (a batch handler's) in one span, with a child span per key of
        ``batch`` (shard, claim, touches of its burst); ``failed`` reads the keys that
        failed from its answer: their spans are marked so, and their retries link to
        them."""
        claims = [claim for _, claim, _ in batch]
        touches = [n for _, _, n in batch]
        where = [(shard, claim.key) for shard, claim, _ in batch]
        kept = await self._kept(where)
        span = self._root(rule, [], {
            "messaging.system": SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": rule,
            "messaging.batch.message_count": len(claims)})
        parent = trace.set_span_in_context(span)
        children = [self._tracer.start_span(f"process {rule}", context=parent,
                                            kind=SpanKind.INTERNAL, links=k.links(),
                                            attributes=_attributes(rule, c, k, n))
                    for c, k, n in zip(claims, kept, touches, strict=True)]
        def mark(answer: T) -> None:
            keys = set(failed(answer))
            for child, (shard, key) in zip(children, where, strict=True):
                if key in keys:
                    child.set_status(Status(StatusCode.ERROR, "failed"))
                    self._remember_try([(shard, key)], child)
        return await self._within(span, children, where, call, mark)

    async def _within(self, span: Span, children: list[Span], where: list[tuple[int, str]],
                      call: Callable[[], Awaitable[T]],
                      answered: Callable[[T], None] | None = None) -> T:
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False,
                                set_status_on_exception=False):
                answer = await call()
            if answered is not None:
                answered(answer)
            return answer
        except BaseException as exc:
            for s in (span, *children):
                s.record_exception(exc)
                s.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            self._remember_try(where, span)
            raise
        finally:
            for s in (*children, span):
                s.end()

    def _remember_try(self, where: list[tuple[int, str]], span: Span) -> None:
        """Keep the failed try's context beside its keys, for the retry to link to."""
        tried = f"0|||{traceparent(span.get_span_context())}"
        loop = asyncio.get_running_loop()
        for shard, key in where:
            task = loop.create_task(self._scripts.traces_put(
                self._keyspace.shard(shard), {key: tried}, KEEP, GRACE_MS))
            self._writes.add(task)
            task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[int]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("keeping a failed try's trace context failed: %r", task.exception())
