"""What runs the handlers of a config's rules: an invoker per rule.

A plain (sync) Python handler runs by default in the node's process pool
(``worker.isolation``: one pool for all the rules, at most the sum of their
``concurrency`` children), or with ``isolation: thread`` (and in a drain of a process
with no node, unless the rule says ``isolation: process``: ``drain()`` runs handlers
in the test's process) on threads of its own rule (``worker.threads``: at most its
``concurrency``); ``async def`` handlers run on the event loop; webhooks go through
one HTTP client, created only when a rule has one. One rule's hung handlers therefore
never take another rule's threads.
"""

from __future__ import annotations

import logging
from typing import Any

from coalescer.config.handler_import import is_async
from coalescer.config.rules import Config, HttpHandler, Rule
from coalescer.worker.invoke import Invoke, invoker_for
from coalescer.worker.isolation import ChildPool, start_fork_server
from coalescer.worker.loop_lag import LoopLag
from coalescer.worker.threads import HandlerThreads

log = logging.getLogger(__name__)


class Handlers:
    """The invokers of a config's rules, and the threads and processes they run on."""

    def __init__(self, config: Config, *, processes: bool = True) -> None:
        """``processes=False``: plain handlers run on threads of this process unless
        their rule says ``isolation: process``."""
        self._threads: dict[str, HandlerThreads] = {}
        self._webhooks: Any = None
        isolated = [r for r in config.rules if r.in_child_process
                    and (processes or (r.isolation is not None and r.isolation.explicit))]
        self.children: ChildPool | None = None
        if isolated:
            self.children = ChildPool(sum(int(r.concurrency) for r in isolated))
            # From this (the event loop's) thread: the fork server dies with it.
            start_fork_server([(r.handler_ref, _folder(r)) for r in isolated])
        self._isolated = {r.name for r in isolated}
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
        if rule.name in self._isolated and self.children is not None:
            base_dir = rule.isolation.base_dir if rule.isolation is not None else None
            return invoker_for(rule, self._webhooks,
                               isolated=self.children.invoker(rule.handler_ref, base_dir))
        threads = self._threads[rule.name] = HandlerThreads(rule.name, size)
        return invoker_for(rule, self._webhooks, threads=threads)

    async def close(self) -> None:
        """Close the HTTP client, stop the idle threads and kill every child process.
        Threads still in a handler are daemon threads: they end with the process."""
        if self._webhooks is not None:
            await self._webhooks.close()
        for threads in self._threads.values():
            threads.close()
        if self.children is not None:
            self.children.close()


def _folder(rule: Rule) -> str | None:
    base_dir = rule.isolation.base_dir if rule.isolation is not None else None
    return str(base_dir) if base_dir is not None else None
