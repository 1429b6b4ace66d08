"""Bulk actions by filter: run-now, retry, cancel or purge every key a search
(``query/key_search.py``) finds, a page at a time, through the scripts that act on
named keys (run_now.lua, requeue.lua, cancel.lua, purge.lua).

A bulk action is rate-limited (``rate`` keys a second, 0 for no limit), reports its
progress after each page, and stops cleanly when ``stop`` is set: the page under way
finishes and nothing after it starts. ``dry_run`` only counts what it would act on.
An action applies only to the states where it means something (``ACTION_STATES``), and
a key that left the state between its page being read and the action is matched but
not changed (docs/cli.md, "keys").

A retry of every dead key of a rule (no filter) goes faster and lighter: no key goes
through the client; requeue_first.lua re-queues the next RANKS_AT_ONCE entries of a
shard's dead set in Redis, one call at a time (``retry_by_rank``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from coalescer.config.rules import Config
from coalescer.query.key_search import (
    Cursor,
    KeyFilter,
    KeysPage,
    PageSize,
    SearchError,
    search_page,
)
from coalescer.query.layout_read import current_space
from coalescer.store.keys import KeySpace, ShardKeys
from coalescer.store.scripts import Scripts

ACTION_STATES = {
    "run-now": ("pending", "scheduled", "paused"),
    "cancel": ("pending", "scheduled", "paused"),
    "retry": ("dead",),
    "purge": ("dead",),
}
# actions that take the keys they change out of the set a page is read from
REMOVES = ("retry", "purge", "cancel")
DEFAULT_RATE = 10_000  # keys a second
PAGE = 1000  # keys a page reads at most
RUN_NOW_AT_ONCE = 64  # run_now.lua calls in flight at once
REQUEUE_AT_ONCE = 250  # keys a requeue.lua call takes: ~1 ms of the server's time
RANKS_AT_ONCE = 100  # dead-set entries a requeue_first.lua call reads: ~0.3 ms of the server
WAKE_EVERY = 0.1  # seconds: how often a whole-rule retry wakes a shard's poller at most

# Acts on a page's keys, all of one shard: how many it changed.
Act = Callable[[ShardKeys, list[str]], Awaitable[int]]
# Drops the pending refreshes of keys (a coalescer's cancel_many): how many it dropped.
Cancel = Callable[[list[str]], Awaitable[int]]


def action_state(action: str, state: str | None) -> str:
    """The state ``action`` acts on: ``state`` if it takes it, else SearchError."""
    if action not in ACTION_STATES:
        raise SearchError("action", f"no bulk action {action!r}; one of "
                                    f"{', '.join(ACTION_STATES)}")
    takes = ACTION_STATES[action]
    if state is None:
        return takes[0]
    if state not in takes:
        raise SearchError("state", f"{action} acts on {' or '.join(takes)} keys, not on "
                                   f"--state {state}")
    return state


@dataclass(slots=True)
class BulkProgress:
    """Where a bulk action stands: set entries read, keys matched, keys changed;
    ``status`` running, done, aborted or failed (``error`` says why)."""

    action: str
    search: KeyFilter
    dry_run: bool = False
    rate: int = DEFAULT_RATE
    examined: int = 0
    matched: int = 0
    done: int = 0
    status: str = "running"
    error: str | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "rule": self.search.rule, "state": self.search.state,
                "where": dict(self.search.where), "dry_run": self.dry_run, "rate": self.rate,
                "examined": self.examined, "matched": self.matched, "done": self.done,
                "status": self.status, "error": self.error,
                "started_ms": int(self.started * 1000),
                "ended_ms": int(self.ended * 1000) if self.ended else None}

    def summary(self) -> str:
        """"retried 1,234 of 1,240 matched (the dead keys of rule r where org=42)"."""
        verb = {"run-now": "made due", "cancel": "cancelled", "retry": "re-queued",
                "purge": "purged"}[self.action]
        if self.dry_run:
            return f"would act on {self.matched} keys ({self.search.describe()})"
        return f"{verb} {self.done} of {self.matched} matched ({self.search.describe()})"


def scripted_act(action: str, redis: Any, scripts: Scripts, rule: str,
                 cancel: Cancel) -> Act:
    """The per-page step of ``action`` on keys of ``rule``."""
    async def retry(shard: ShardKeys, keys: list[str]) -> int:
        # Calls of a few hundred keys, sent together: none holds the server long, so
        # other clients' commands run between them; the last one, once the others are
        # done, wakes the shard's poller (once a page, not once a call).
        *first, last = _parts(keys, REQUEUE_AT_ONCE)
        done = await asyncio.gather(*(scripts.requeue_each(shard, rule, part, wake=False)
                                      for part in first))
        early = sum(n for n, _ in done)
        late = (await scripts.requeue_each(shard, rule, last))[0]
        if early and not late:  # the last call woke no poller: wake it for the others
            await scripts.requeue_each(shard, rule, [])
        return early + late

    async def purge(shard: ShardKeys, keys: list[str]) -> int:
        return (await scripts.purge(shard, rule, keys))[0]

    async def run_now(shard: ShardKeys, keys: list[str]) -> int:
        made = 0
        for at in range(0, len(keys), RUN_NOW_AT_ONCE):
            found = await asyncio.gather(*(scripts.run_now(shard, rule, key)
                                           for key in keys[at:at + RUN_NOW_AT_ONCE]))
            made += sum(state == "hastened" for state in found)
        return made

    async def cancelled(shard: ShardKeys, keys: list[str]) -> int:
        return await cancel(keys)

    return {"retry": retry, "purge": purge, "run-now": run_now, "cancel": cancelled}[action]


def _parts(keys: list[str], size: int) -> list[list[str]]:
    return [keys[at:at + size] for at in range(0, len(keys), size)]


def page_size(rate: int) -> int:
    """Keys a page reads: a quarter second's worth at ``rate``, 1 to PAGE."""
    return PAGE if rate <= 0 else max(1, min(PAGE, rate // 4))


def by_rank(progress: BulkProgress) -> bool:
    """Whether the action runs in Redis by ranks of the set (``retry_by_rank``): a retry
    of every dead key of a rule (no ``where``), not a dry run."""
    return (progress.action == "retry" and progress.search.state == "dead"
            and not progress.search.where and not progress.dry_run)


async def run_bulk(redis: Any, config: Config, progress: BulkProgress, act: Act | None,
                   on_page: Callable[[BulkProgress], None] | None = None) -> BulkProgress:
    """Act (``act``; None: count only) on every key of ``progress.search``, a page at a
    time, at ``progress.rate`` keys a second, until done or ``progress.stop`` is set.
    A page is read once its page before was acted on, right after that page's last
    entry; an action that takes the keys it changed out of the set read (retry, purge,
    cancel) moves the cursor's rank back by as many, so the read starts where it is.
    A retry of a whole rule runs faster by ranks (``by_rank``, ``retry_by_rank``)."""
    size = PageSize(scan=page_size(progress.rate), limit=page_size(progress.rate),
                    captures=False)
    removes = act is not None and progress.action in REMOVES
    began = time.monotonic()
    at: Cursor | None = None
    with _recorded(progress):
        while True:
            page = await search_page(redis, config, progress.search, at, size)
            done = await _apply(page, act, progress, config.namespace)
            if on_page is not None:
                on_page(progress)
            if page.next is None:
                progress.status = "done"
                break
            at = page.next.moved_back(done.get(page.next.shard, 0) if removes else 0)
            if await _paused_for_rate(progress, began):
                progress.status = "aborted"
                break
    return progress


async def retry_by_rank(redis: Any, config: Config, scripts: Scripts, progress: BulkProgress,
                        on_page: Callable[[BulkProgress], None] | None = None) -> BulkProgress:
    """Retry every dead key of ``progress.search.rule``, shard by shard, with
    requeue_first.lua calls of at most RANKS_AT_ONCE entries, one at a time (other
    clients' commands run between them), at ``progress.rate`` keys a second, until done
    or ``progress.stop`` is set. No key goes through this client: each call reads the
    next entries of the dead set in Redis, from the rank past the entries that stayed
    (a state that is not dead; should another client take some of those out meanwhile,
    as many entries after them are stepped over, and running it again takes them).
    Each shard's poller is woken at most every WAKE_EVERY seconds while its keys come
    back, and once after its last (a stop included)."""
    run = _RankRetry(scripts, progress, on_page)
    with _recorded(progress):
        space = await current_space(redis, config)
        for shard in range(space.span):
            if not await run.shard(space.shard(shard)):
                progress.status = "aborted"
                break
        else:
            progress.status = "done"
    return progress


@contextlib.contextmanager
def _recorded(progress: BulkProgress) -> Iterator[None]:
    """Around a bulk action: a failure is recorded in ``progress`` (and raised), and
    its end time in any case."""
    try:
        yield
    except Exception as exc:
        progress.status, progress.error = "failed", repr(exc)
        raise
    finally:
        progress.ended = time.time()


@dataclass(slots=True)
class _RankRetry:
    scripts: Scripts
    progress: BulkProgress
    on_page: Callable[[BulkProgress], None] | None
    began: float = field(default_factory=time.monotonic)

    @property
    def count(self) -> int:
        rate = self.progress.rate
        return RANKS_AT_ONCE if rate <= 0 else max(1, min(RANKS_AT_ONCE, rate // 4))

    async def shard(self, shard: ShardKeys) -> bool:
        """Every dead key of one shard: whether it ran to the end (False: stopped)."""
        rule, count, progress = self.progress.search.rule, self.count, self.progress
        start, woken, unannounced, stopped = 0, time.monotonic(), False, False
        while not stopped:
            wake = time.monotonic() - woken >= WAKE_EVERY
            back, read = await self.scripts.requeue_first(shard, rule, start, count, wake=wake)
            if back and wake:  # this call woke the poller
                woken, unannounced = time.monotonic(), False
            elif back:
                unannounced = True
            start += read - back
            progress.examined += read
            progress.matched += read
            progress.done += back
            if self.on_page is not None:
                self.on_page(progress)
            if read < count:
                break
            stopped = await _paused_for_rate(progress, self.began)
        if unannounced:  # keys came back since the last wake: wake the poller
            await self.scripts.requeue_each(shard, rule, [])
        return not stopped


async def _apply(page: KeysPage, act: Act | None, progress: BulkProgress,
                 namespace: str) -> dict[int, int]:
    """Act on the page's keys, shard by shard: how many changed in each shard."""
    progress.examined += page.examined
    progress.matched += len(page.keys)
    done: dict[int, int] = {}
    if act is None or not page.keys:
        return done
    by_shard: dict[int, list[str]] = {}
    for found in page.keys:
        by_shard.setdefault(found.shard, []).append(found.key)
    space = KeySpace(namespace, 1)
    for shard, keys in by_shard.items():
        done[shard] = await act(space.shard(shard), keys)
        progress.done += done[shard]
    return done


async def _paused_for_rate(progress: BulkProgress, began: float) -> bool:
    """Wait as long as the rate asks (``matched`` keys at ``rate`` a second); whether
    ``stop`` was set meanwhile (or before)."""
    delay = 0.0
    if progress.rate > 0 and not progress.dry_run:
        delay = progress.matched / progress.rate - (time.monotonic() - began)
    stop = progress.stop
    if delay <= 0:
        await asyncio.sleep(0)  # let a stop in
        return stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), timeout=delay)
    except TimeoutError:
        return stop.is_set()
    return True
