"""``Query``: every read of a namespace, and the dead-letter operations, in one place.

A coalescer exposes one as ``coalescer.query``; the CLI, the HTTP API and the
page read through it. Each call uses the coalescer's connection of the moment,
so it raises ClosedError while the coalescer is not connected.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from coalescer.config.rules import Config
from coalescer.query.bulk import (
    BulkProgress,
    Cancel,
    by_rank,
    retry_by_rank,
    run_bulk,
    scripted_act,
)
from coalescer.query.controls import RunNowOutcome, paused_rules, run_now, set_paused
from coalescer.query.dead_letters import (
    Action,
    DeadOutcome,
    DeadPage,
    act_on_all,
    act_on_keys,
    list_dead,
    look_up_dead,
)
from coalescer.query.due import DEFAULT_SHOWN, next_due
from coalescer.query.explain import gather_explain
from coalescer.query.history import HistoryQuery, Refresh, read_history
from coalescer.query.key_search import DEFAULT_PAGE, KeyFilter, KeysPage, PageSize, search_page
from coalescer.query.scheduled_keys import scheduled_keys
from coalescer.query.status import gather_status
from coalescer.query.timeline import gather_timeline
from coalescer.store.audit_stream import AuditRecord, read_audit
from coalescer.store.scripts import Scripts

# The client and scripts of the coalescer's connection; raises ClosedError without one.
Connected = Callable[[], tuple[Any, Scripts]]
# What raises redis-py's connection errors met in a read as coalescer's own.
Explained = Callable[[], contextlib.AbstractAsyncContextManager[None]]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _explained(read: Callable[Concatenate[Query, _P], Coroutine[Any, Any, _T]],
               ) -> Callable[Concatenate[Query, _P], Coroutine[Any, Any, _T]]:
    """``read``, its Redis connection and password errors raised as coalescer's own."""
    @functools.wraps(read)
    async def call(self: Query, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        async with self._explained():
            return await read(self, *args, **kwargs)
    return call


class Query:
    """Reads a coalescer's namespace: status, explain, history, the next due keys and
    the dead letters, which it also re-queues and purges; and the operator's controls:
    pause and resume a rule, run keys now."""

    def __init__(self, config: Callable[[], Config], connected: Connected,
                 explained: Explained = contextlib.nullcontext) -> None:
        self._config = config
        self._connected = connected
        self._explained = explained

    @property
    def _redis(self) -> Any:
        return self._connected()[0]

    @_explained
    async def status(self) -> dict[str, Any]:
        """The JSON of ``coalescer status --json``."""
        return await gather_status(self._redis, self._config())

    @_explained
    async def explain(self, key: str) -> dict[str, Any]:
        """Where ``key`` stands and why (the JSON of ``coalescer explain KEY --json``).

        Its rule and settings; its state (idle, pending with its due time and
        whether the window or the max wait set it, backoff with the last error,
        running with node, token and lease left, or dead with its error); its
        burst's first and last touch; attempts; its last refreshes from the
        history. Raises UnknownKeyError when no rule matches ``key``.
        """
        return await gather_explain(self._redis, self._config(), key)

    @_explained
    async def timeline(self, key: str, *, at_ms: int | None = None,
                       trace_url: str | None = None) -> dict[str, Any]:
        """``key``'s recent events (the JSON of ``coalescer timeline KEY --json``), and
        with ``at_ms`` which refresh covered a write then (query/timeline.py). Raises
        UnknownKeyError when no rule matches ``key``."""
        return await gather_timeline(self._redis, self._config(), key, at_ms=at_ms,
                                     trace_url=trace_url)

    @_explained
    async def history(self, query: HistoryQuery | None = None) -> list[Refresh]:
        """Recent refreshes, newest first, across every shard (see HistoryQuery)."""
        return await read_history(self._redis, self._config(), query or HistoryQuery())

    @_explained
    async def next_due(self, per_rule: int = DEFAULT_SHOWN) -> dict[str, Any]:
        """The earliest ``per_rule`` pending keys of each rule, with the server clock:
        ``{"now_ms", "rules": {RULE: [{"key", "due_ms", "shard"}, ...]}}``."""
        return await next_due(self._redis, self._config(), per_rule)

    @_explained
    async def scheduled_keys(self, rule: str | None = None, limit: int = 20) -> dict[str, Any]:
        """The ``limit`` soonest keys scheduled by a touch's own time (``at``/``delay``),
        of ``rule`` or of every rule, with their times (query/scheduled_keys.py)."""
        return await scheduled_keys(self._redis, self._config(), rule, limit)

    @_explained
    async def dead_letters(self, keys: Sequence[str] | None = None, *, rule: str | None = None,
                           limit: int = 20, offset: int = 0) -> DeadPage:
        """A page of dead letters, oldest first, with the total count.

        With ``keys``, those keys' dead letters (``not_dead`` lists the named keys
        that are not dead); else every dead key, or those of ``rule`` (KeyError if
        there is no such rule), ``limit`` from ``offset``.
        """
        if keys is not None:
            return await look_up_dead(self._redis, self._config(), keys)
        return await list_dead(self._redis, self._config(), rule=rule, limit=limit,
                               offset=offset)

    @_explained
    async def retry_dead(self, keys: Sequence[str] | None = None, *,
                         rule: str | None = None) -> DeadOutcome:
        """Re-queue dead keys, due now with fresh attempts: the named ``keys``, else
        every dead key (of ``rule``, if given). Named keys that are not dead are left
        alone and listed in ``not_dead``; ``done`` counts the keys re-queued."""
        return await self._on_dead(lambda s: s.requeue_each, keys, rule)

    @_explained
    async def purge_dead(self, keys: Sequence[str] | None = None, *,
                         rule: str | None = None) -> DeadOutcome:
        """Delete dead keys for good (state and dead letter): the named ``keys``, else
        every dead key (of ``rule``, if given). Only keys still dead are purged; the
        named others are listed in ``not_dead``. A purged key touched again starts
        a fresh burst."""
        return await self._on_dead(lambda s: s.purge, keys, rule)

    @_explained
    async def pause(self, rule: str) -> bool:
        """Pause ``rule`` on every node (and across restarts): its keys keep collecting
        touches and none runs until ``resume``. Whether it was not paused before;
        KeyError if there is no such rule."""
        return await set_paused(self._redis, self._config(), rule, paused=True)

    @_explained
    async def resume(self, rule: str) -> bool:
        """Resume a paused ``rule``: its due keys run at once. Whether it was paused;
        KeyError if there is no such rule."""
        return await set_paused(self._redis, self._config(), rule, paused=False)

    @_explained
    async def paused(self) -> list[str]:
        """The names of the rules paused now."""
        return await paused_rules(self._redis, self._config())

    @_explained
    async def run_now(self, keys: Sequence[str]) -> RunNowOutcome:
        """Make the keys' pending refreshes due now (window, max wait, time or backoff
        skipped) and wake their pollers; see RunNowOutcome. UnknownKeyError or
        InvalidKeyError (checked before anything runs) runs nothing."""
        redis, scripts = self._connected()
        return await run_now(redis, scripts, self._config(), list(keys))

    @_explained
    async def keys(self, search: KeyFilter, cursor: str | None = None,
                   size: PageSize = DEFAULT_PAGE) -> KeysPage:
        """One page of a search of a rule's keys by capture and state, from ``cursor``
        (query/key_search.py: build ``search`` with ``make_filter``)."""
        return await search_page(self._redis, self._config(), search, cursor, size)

    @_explained
    async def bulk(self, progress: BulkProgress, cancel: Cancel,
                   on_page: Callable[[BulkProgress], None] | None = None) -> BulkProgress:
        """Run a bulk action (query/bulk.py) until done or ``progress.stop`` is set;
        ``cancel`` drops pending refreshes (the coalescer's ``cancel_many``)."""
        redis, scripts = self._connected()
        act = None if progress.dry_run else scripted_act(
            progress.action, redis, scripts, progress.search.rule, cancel)
        if by_rank(progress):  # a whole rule's retry: in Redis, no key through here
            return await retry_by_rank(redis, self._config(), scripts, progress, on_page)
        return await run_bulk(redis, self._config(), progress, act, on_page)

    @_explained
    async def audit(self, limit: int = 50, before: str | None = None) -> list[AuditRecord]:
        """The newest ``limit`` operator actions of the audit log, newest first (older
        than the entry id ``before`` when given)."""
        return await read_audit(self._redis, self._config().namespace, limit=limit,
                                before=before)

    async def _on_dead(self, action: Callable[[Scripts], Action], keys: Sequence[str] | None,
                       rule: str | None) -> DeadOutcome:
        redis, scripts = self._connected()
        if keys is not None:
            return await act_on_keys(redis, self._config(), action(scripts), keys)
        return await act_on_all(redis, self._config(), action(scripts), rule)
