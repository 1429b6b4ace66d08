"""What runs the handlers of a config's rules: an invoker per rule.

A plain (sync) Python handler runs on threads of its own rule (``worker.threads``:
at most its ``concurrency``), or with ``isolation: process`` in child processes of
its own rule (``worker.isolation``); ``async def`` handlers run on the event loop;
webhooks go through one HTTP client, created only when a rule has one. One rule's
hung handlers therefore never take another rule's threads.
"""

from __future__ import annotations

import logging
from typing import Any

from coalescer.config.handler_import import is_async
from coalescer.config.rules import Config, HttpHandler, Rule
from coalescer.worker.invoke import Invoke, invoker_for
from coalescer.worker.isolation import ChildPool
from coalescer.worker.loop_lag import LoopLag
from coalescer.worker.threads import HandlerThreads

log = logging.getLogger(__name__)


class Handlers:
    """The invokers of a config's rules, and the threads and processes they run on."""

    def __init__(self, config: Config) -> None:
        self._threads: dict[str, HandlerThreads] = {}
        self.children: dict[str, ChildPool] = {}
        self._webhooks: Any = None
        self.loop_lag = LoopLag()  # names an async handler that blocks the event loop
        if any(isinstance(r.handler, HttpHandler) for r in config.rules):
            from coalescer.worker.webhooks import Webhooks
            self._webhooks = Webhooks()
        self.invokers: dict[str, Invoke] = {r.name: self._invoker(r) for r in config.rules}

    def _invoker(self, rule: Rule) -> Invoke:
        handler = rule.handler
        if not callable(handler):
            return invoker_for(rule, self._webhooks)
        if is_async(handler):
            return self.loop_lag.wrap(rule.name, rule.handler_ref,
                                      invoker_for(rule, self._webhooks))
        size = int(rule.concurrency)
        if rule.isolation is not None:
            pool = ChildPool(rule.name, rule.handler_ref, rule.isolation.base_dir, size)
            self.children[rule.name] = pool
            return invoker_for(rule, self._webhooks, isolated=pool.call)
        threads = self._threads[rule.name] = HandlerThreads(rule.name, size)
        return invoker_for(rule, self._webhooks, threads=threads)

    async def close(self) -> None:
        """Close the HTTP client, stop the idle threads and kill every child process.
        Threads still in a handler are daemon threads: they end with the process."""
        if self._webhooks is not None:
            await self._webhooks.close()
        for threads in self._threads.values():
            threads.close()
        for pool in self.children.values():
            pool.close()
