"""Names ``async def`` handlers that block the event loop (``time.sleep``, a blocking
database driver): while one blocks, everything else of the node waits, its lease
renewals too, so the fault would otherwise show only as "lease lapsed".

An async handler's coroutine runs on the loop in steps, one from each ``await`` that
waits to the next; the loop does nothing else during a step. Each step of a watched
handler is timed (two clock reads; no timer, no thread): one that held the loop for
``threshold`` seconds or more is logged once per rule, naming the rule and handler,
how long it blocked the loop, and what to do instead. Only that handler is named,
never another async handler that merely ran at the same time.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

log = logging.getLogger(__name__)

THRESHOLD = 0.5  # seconds one step may hold the loop before its handler is named

Invoke = Callable[[Any], Awaitable[object]]


class LoopLag:
    """Times the steps of async handlers' runs; warns once per rule of one that blocks."""

    def __init__(self, *, threshold: float = THRESHOLD) -> None:
        self.threshold = threshold
        self.warned: set[str] = set()  # the rules named already

    def wrap(self, rule: str, handler: str, invoke: Invoke) -> Invoke:
        """``invoke`` (an async handler of ``rule``), each step of its runs timed."""
        async def watched(claim: Any) -> object:
            coro = invoke(claim)
            if not isinstance(coro, Coroutine):
                return await coro
            return await _Timed(coro, lambda took: self._took(rule, handler, took))
        return watched

    def _took(self, rule: str, handler: str, took: float) -> None:
        if took >= self.threshold and rule not in self.warned:
            self.warned.add(rule)
            log.warning("rule %r: its async handler %s blocked the event loop for %.1fs: "
                        "use `def` (runs in a child process) or await non-blocking calls (the "
                        "node's leases and touches wait while it blocks)", rule, handler,
                        took)


class _Timed:
    """Awaits ``coro`` as ``await coro`` would, passing each step's duration to
    ``took`` (a step: from the loop resuming it to its next wait, or its end)."""

    __slots__ = ("_coro", "_took")

    def __init__(self, coro: Coroutine[Any, Any, object],
                 took: Callable[[float], None]) -> None:
        self._coro = coro
        self._took = took

    def __await__(self) -> Generator[Any, Any, object]:
        coro = self._coro
        step: Callable[[], Any] = functools.partial(coro.send, None)
        while True:
            began = time.perf_counter()
            try:
                waits_on = step()
            except StopIteration as done:
                self._took(time.perf_counter() - began)
                return done.value
            except BaseException:
                self._took(time.perf_counter() - began)
                raise
            self._took(time.perf_counter() - began)
            step = yield from _resumed(coro, waits_on)


def _resumed(coro: Coroutine[Any, Any, object],
             waits_on: Any) -> Generator[Any, Any, Callable[[], Any]]:
    """Hand ``waits_on`` to the task; what it resumes ``coro`` with, as the next step."""
    try:
        value = yield waits_on
    except GeneratorExit:
        coro.close()
        raise
    except BaseException as exc:  # cancelled, or the awaited future failed
        return functools.partial(coro.throw, exc)
    return functools.partial(coro.send, value)
