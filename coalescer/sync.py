"""``SyncCoalescer``: the same touch and flush for synchronous, threaded code."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from coalescer.coalescer import CLOSE_FLUSH_TIMEOUT, Coalescer
from coalescer.common import forksafe
from coalescer.config.code_rules import Rules
from coalescer.config.priority import Priority
from coalescer.config.rules import Config
from coalescer.config.schedule import At, Delay
from coalescer.errors import ClosedError, UnwrittenTouchesError
from coalescer.facade.touching import one_touch
from coalescer.write.cancel import CancelOutcome
from coalescer.write.room import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)


class SyncCoalescer:
    """Runs a ``Coalescer`` on an event loop in a daemon thread of its own.

    ``touch()`` is as cheap as the async one and safe from any thread;
    ``flush()`` blocks until Redis holds every earlier touch. Use as ``with``
    (or call ``start()`` and ``close()``), e.g. once per Django or Flask process.
    Fork-safe: in a forked process the first ``touch()`` or ``flush()`` starts it
    again there, with an empty buffer (docs/operations.md, "Forking servers").
    """

    def __init__(self, coalescer: Coalescer | None = None, *,
                 rules: Config | Rules | None = None, **options: Any) -> None:
        """``SyncCoalescer(Coalescer(...))``, or ``SyncCoalescer(rules=Rules(...),
        **options)`` with ``Coalescer``'s options (``worker`` defaults to False here)."""
        if coalescer is None and rules is not None:
            options.setdefault("worker", False)
            coalescer = Coalescer(rules=rules, **options)
        elif coalescer is None or rules is not None or options:
            raise TypeError("give SyncCoalescer(coalescer), or SyncCoalescer(rules=..., "
                            "**options) with Coalescer's options")
        self.coalescer = coalescer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = False  # start() was called (in this process or before a fork)
        self._restart = False  # started before this process forked: start on first use
        self._lock = threading.Lock()
        self._pid = os.getpid()
        forksafe.track(self)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **options: Any) -> SyncCoalescer:
        options.setdefault("worker", False)
        return cls(Coalescer.from_yaml(path, **options))

    def after_fork(self) -> None:
        """In a forked child (no-op elsewhere): park the parent's loop and thread, and
        start again on first use."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the parent's may have been held at the fork
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        forksafe.park((loop, thread))
        self._loop = self._thread = None
        self._restart = True

    def _call(self, what: str, coro: Any, timeout: float | None = None) -> Any:
        try:
            loop = self._ready(what)
        except ClosedError:
            coro.close()
            raise
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result(timeout)

    def _revive(self, what: str) -> asyncio.AbstractEventLoop | None:
        """The loop, after starting again in a forked child if this is one; else None."""
        with self._lock:
            if self._loop is None and self._restart:
                log.info("SyncCoalescer: starting again in forked process %d (on %s)",
                         os.getpid(), what)
                self.start()
            return self._loop

    def _ready(self, what: str) -> asyncio.AbstractEventLoop:
        """The loop; ClosedError unless started (started again first in a forked child)."""
        loop = self._loop if self._loop is not None else self._revive(what)
        if loop is None:
            raise self._not_started(what)
        return loop

    def _not_started(self, what: str) -> ClosedError:
        if self._started:
            return ClosedError(f"{what}: the SyncCoalescer is closed")
        return ClosedError(f"{what}: the SyncCoalescer is not started; call start() "
                           "first, or use it as 'with SyncCoalescer...'")

    def start(self, timeout: float = 30.0) -> None:
        forksafe.repair_after_foreign_fork()  # before starting a thread: see forksafe
        self.after_fork()
        self._started, self._restart = True, False
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="coalescer-loop",
                                  daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.coalescer.start(), loop).result(timeout)
        except BaseException:
            _stop(loop, thread)
            raise
        # Published once started: a touch from another thread meanwhile waits in _revive.
        self._loop, self._thread = loop, thread
        atexit.unregister(self._close_at_exit)  # at most once (a restart after a fork)
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        """At interpreter exit, a coalescer still open is closed: its buffered touches
        are written (or logged as lost by close()), never dropped without a word."""
        if self._loop is None or self._pid != os.getpid():
            return
        log.info("closing the SyncCoalescer at exit: it was never closed")
        try:
            self.close()
        except Exception:  # at exit: close() logged the keys it lost
            log.debug("close() at exit failed", exc_info=True)

    def touch(self, key: str, item: str | None = None, *, at: At | None = None,  # noqa: PLR0913
              delay: Delay | None = None, keep_items: bool = False,
              priority: Priority | None = None) -> None:
        """Buffer one touch (with ``item``, a time ``at``/``delay`` and a ``priority``, if
        given); see ``Coalescer.touch``."""
        self._ready(f"touch({key!r})")
        self.coalescer.touch(key, item, at=at, delay=delay, keep_items=keep_items,
                             priority=priority)

    def touch_many(self, keys: Iterable[str], *, at: At | None = None,
                   delay: Delay | None = None, keep_items: bool = False,
                   priority: Priority | None = None) -> None:
        """Buffer every touch or none; see ``Coalescer.touch_many``."""
        self._ready("touch_many()")
        self.coalescer.touch_many(keys, at=at, delay=delay, keep_items=keep_items,
                                  priority=priority)

    def touch_items(self, pairs: Iterable[tuple[str, str]], *, at: At | None = None,
                    delay: Delay | None = None, keep_items: bool = False) -> None:
        """Buffer every (key, item) touch or none; see ``Coalescer.touch_items``."""
        self._ready("touch_items()")
        self.coalescer.touch_items(pairs, at=at, delay=delay, keep_items=keep_items)

    def touch_wait(self, key: str, item: str | None = None, *,
                   timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                   delay: Delay | None = None) -> None:
        """``touch(key)`` that blocks this thread while the buffer is full, for bulk
        writers; see ``Coalescer.touch_wait``. Request paths that must never block call
        ``touch``, which refuses at once."""
        what = f"touch_wait({key!r})"
        self._ready(what)
        keys, pairs = one_touch(key, item)
        self.coalescer.touch_blocking(keys, timeout=timeout, what=what, pairs=pairs, at=at,
                                      delay=delay)

    def touch_many_wait(self, keys: Iterable[str], *,
                        timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                        delay: Delay | None = None) -> None:
        """Touch every key, blocking while the buffer is full; see
        ``Coalescer.touch_many_wait`` for what is checked first and what a timeout keeps."""
        what = "touch_many_wait()"
        self._ready(what)
        self.coalescer.touch_blocking(keys, timeout=timeout, what=what, at=at, delay=delay)

    def cancel(self, key: str, *, timeout: float | None = 30.0) -> CancelOutcome:
        """Drop ``key``'s pending refresh; see ``Coalescer.cancel_many``."""
        return self.cancel_many([key], timeout=timeout)

    def cancel_many(self, keys: Iterable[str], *,
                    timeout: float | None = 30.0) -> CancelOutcome:
        """Drop the keys' pending refreshes; see ``Coalescer.cancel_many``."""
        self.after_fork()
        outcome: CancelOutcome = self._call("cancel()", self.coalescer.cancel_many(list(keys)),
                                            timeout)
        return outcome

    def touch_items_wait(self, pairs: Iterable[tuple[str, str]], *,
                         timeout: float | None = DEFAULT_TIMEOUT, at: At | None = None,
                         delay: Delay | None = None) -> None:
        """Touch every (key, item) pair, blocking while the buffer is full; see
        ``Coalescer.touch_items_wait``."""
        what = "touch_items_wait()"
        self._ready(what)
        self.coalescer.touch_blocking([], timeout=timeout, what=what, pairs=pairs, at=at,
                                      delay=delay)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until Redis holds every touch made before this call; see
        ``Coalescer.flush`` for what it raises."""
        self.after_fork()
        self._call("flush()", self.coalescer.flush(), timeout)

    def close(self, timeout: float | None = None, *,
              flush_timeout: float = CLOSE_FLUSH_TIMEOUT) -> None:
        """Flush, stop and join the loop thread; idempotent. Touches that could not be
        written within ``flush_timeout`` raise UnwrittenTouchesError, once everything
        is stopped (see ``Coalescer.close``)."""
        self.after_fork()
        self._restart = False
        atexit.unregister(self._close_at_exit)
        if self._loop is None:
            return
        try:
            self._call("close()", self.coalescer.close(flush_timeout=flush_timeout), timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            _stop(loop, self._thread)

    def __enter__(self) -> SyncCoalescer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except UnwrittenTouchesError:
            if exc is None:
                raise
            # the body's own error goes on; the unwritten keys were logged by close()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread | None) -> None:
    loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join()
    loop.close()
