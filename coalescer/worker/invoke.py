"""Turns a rule's handler into one coroutine function: ``await invoke(claim)``, or for a
batch rule ``await invoke(claims)`` (a list), whose result says which keys failed.

A plain (sync) handler runs on its rule's own threads (``worker.threads``), or with
``isolation: process`` in its rule's child processes (``worker.isolation``). A run
cancelled while such a handler goes on (a thread cannot be stopped; a child is being
killed) ends in ``RunCancelled``, which says whether the handler had started and carries
a future done once it has ended: the runner holds the run's slot until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from coalescer.claim import Claim
from coalescer.config.handler_import import is_async
from coalescer.config.rules import Rule
from coalescer.worker.threads import HandlerThreads

# Called with a Claim, or with a list of them for a batch rule; returns the handler's
# answer (what a batch handler returns says which of its keys failed).
Invoke = Callable[[Any], Awaitable[object]]


class WebhookCaller(Protocol):
    async def call(self, spec: Any, claim: Claim, timeout: float) -> None: ...

    async def call_batch(self, spec: Any, claims: list[Claim], timeout: float) -> object: ...


class RunCancelled(asyncio.CancelledError):
    """An invoker cancelled while its handler may go on: ``started`` says whether the
    handler had begun (``why`` it had not); ``ends``, when set, is done once the handler
    has ended (its thread returned, its child process is gone)."""

    def __init__(self, *, started: bool, ends: asyncio.Future[Any] | None,
                 why: str = "") -> None:
        super().__init__(why or "cancelled")
        self.started = started
        self.ends = ends
        self.why = why


class NotStartedError(Exception):
    """A run whose timeout came before its handler began."""


def python_invoker(fn: Callable[..., object], threads: HandlerThreads | None) -> Invoke:
    """``async def`` handlers are awaited; plain functions run on ``threads``."""
    if is_async(fn):
        async def call_async(claim: Any) -> object:
            return await fn(claim)  # type: ignore[misc]
        return call_async
    if threads is None:
        raise RuntimeError(f"{fn!r} is a plain function: it needs threads to run on")
    return thread_invoker(fn, threads)


def thread_invoker(fn: Callable[..., object], threads: HandlerThreads) -> Invoke:
    """A plain function run on ``threads``; cancelled, it ends in ``RunCancelled``
    unless the thread had already returned."""
    async def call_sync(claim: Any) -> object:
        future = threads.submit(fn, claim)
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.done():
                raise
            if future.cancel():
                raise RunCancelled(started=False, ends=None, why="no free thread") from None
            raise RunCancelled(started=True, ends=_returned(future)) from None
        if inspect.isawaitable(result):
            return await result
        return result
    return call_sync


def _returned(future: Future[Any]) -> asyncio.Future[None]:
    """A future of the running loop, done once ``future`` (run on a thread) is."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not ended.done():
            ended.set_result(None)

    def done(_: Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle)
    future.add_done_callback(done)
    return ended


def invoker_for(rule: Rule, webhooks: WebhookCaller | None, *,
                threads: HandlerThreads | None = None, isolated: Invoke | None = None
                ) -> Invoke:
    """The invoker of ``rule``'s handler: a Python callable (run on ``threads`` when
    plain, or through ``isolated``, its child processes, when given), or a webhook."""
    handler = rule.handler
    if callable(handler):
        return isolated if isolated is not None else python_invoker(handler, threads)
    if webhooks is None:
        raise RuntimeError(f"rule {rule.name!r}: webhook handlers need a webhook caller")

    if rule.batch is not None:
        async def call_batch_webhook(claims: list[Claim]) -> object:
            return await webhooks.call_batch(handler, claims, rule.timeout)
        return call_batch_webhook

    async def call_webhook(claim: Any) -> object:
        await webhooks.call(handler, claim, rule.timeout)
        return None
    return call_webhook
