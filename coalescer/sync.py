"""``SyncCoalescer``: the same touch and flush for synchronous, threaded code."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from .coalescer import Coalescer


class SyncCoalescer:
    """Runs a ``Coalescer`` on an event loop in a daemon thread of its own.

    ``touch()`` is as cheap as the async one and safe from any thread;
    ``flush()`` blocks until Redis holds every earlier touch. Use as ``with``
    (or call ``start()`` and ``close()``), e.g. once per Django or Flask process.
    """

    def __init__(self, coalescer: Coalescer) -> None:
        self.coalescer = coalescer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **options: Any) -> SyncCoalescer:
        options.setdefault("worker", False)
        return cls(Coalescer.from_yaml(path, **options))

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        if self._loop is None:
            coro.close()
            raise RuntimeError("SyncCoalescer is not started")
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def start(self, timeout: float = 30.0) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="coalescer-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self.coalescer.start(), timeout)
        except BaseException:
            self._stop_loop()
            raise

    def touch(self, key: str) -> None:
        """Buffer one touch; see ``Coalescer.touch``."""
        self.coalescer.touch(key)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until Redis holds every touch made before this call."""
        self._call(self.coalescer.flush(), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop and join the loop thread; idempotent."""
        if self._loop is None:
            return
        try:
            self._call(self.coalescer.close(), timeout)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join()
        loop.close()

    def __enter__(self) -> SyncCoalescer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
