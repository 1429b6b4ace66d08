"""The threads that run one rule's plain (sync) handler.

Each rule with a plain function handler gets a pool of its own, of at most its
``concurrency`` threads (a batch rule: one a call). The runner never starts more runs
of a rule than it has slots, and a run that outlived its timeout or its claim keeps
its slot until its thread returns, so a run never waits here for a thread: one
handler that never returns costs one thread of its own rule, and no other rule's.

The threads are daemon threads: a handler that never returns does not keep the
process from exiting (a stdlib executor's threads are joined at interpreter exit).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Call = tuple[Future[Any], Callable[[Any], object], Any]

_numbers = itertools.count(1)


class HandlerThreads:
    """Up to ``size`` daemon threads, started as calls come and kept for the next ones."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # released by each thread waiting for a call
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[[Any], object], arg: Any) -> Future[Any]:
        """Run ``fn(arg)`` on a free thread; the future is cancellable until it starts."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the handler threads of rule {self._name} are closed")
            self._calls.put((future, fn, arg))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._size:
                self._start_thread()
        return future

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, daemon=True,
                                  name=f"coalescer-{self._name}-{next(_numbers)}")
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, fn, arg = call
            del call
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(arg)
                except BaseException as exc:  # the handler's failure is data
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, arg
            self._idle.release()

    @property
    def alive(self) -> int:
        """How many of the threads still run (a stopped pool: those still in a handler)."""
        return sum(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        """Stop the idle threads (and the others when their handler returns); calls not
        started are cancelled. Idempotent; never waits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
            for _ in self._threads:
                self._calls.put(None)
