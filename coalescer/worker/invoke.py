"""Turns a rule's handler into one coroutine function: ``await invoke(claim)``, or for a
batch rule ``await invoke(claims)`` (a list), whose result says which keys failed."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from coalescer.claim import Claim
from coalescer.config.rules import Rule

# Called with a Claim, or with a list of them for a batch rule; returns the handler's
# answer (what a batch handler returns says which of its keys failed).
Invoke = Callable[[Any], Awaitable[object]]


class WebhookCaller(Protocol):
    async def call(self, spec: Any, claim: Claim, timeout: float) -> None: ...

    async def call_batch(self, spec: Any, claims: list[Claim], timeout: float) -> object: ...


def _is_async(fn: Callable[..., object]) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    method = type(target).__call__ if not inspect.isroutine(target) else None
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(method)


def python_invoker(fn: Callable[..., object], executor: Executor) -> Invoke:
    """``async def`` handlers are awaited; plain functions run in ``executor``."""
    if _is_async(fn):
        async def call_async(claim: Any) -> object:
            return await fn(claim)  # type: ignore[misc]
        return call_async

    async def call_sync(claim: Any) -> object:
        result = await asyncio.get_running_loop().run_in_executor(executor, fn, claim)
        if inspect.isawaitable(result):
            return await result
        return result
    return call_sync


def invoker_for(rule: Rule, executor: Executor, webhooks: WebhookCaller | None) -> Invoke:
    """The invoker of ``rule``'s handler: a Python callable or an HTTP webhook."""
    handler = rule.handler
    if callable(handler):
        return python_invoker(handler, executor)
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
