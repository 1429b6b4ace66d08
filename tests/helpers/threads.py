"""Threads that outlive what started them: the suite checks each test module for them.

A thread still alive after its test module ended is a connection, a pool or a source
someone forgot to close; a non-daemon one also keeps the test process from exiting.
"""

from __future__ import annotations

import threading
import time
import weakref

# Threads a session fixture starts (once, in whichever module first needs it) and stops
# at the end of the session: named with this prefix.
SESSION_PREFIX = "session-"


# thread -> the test running when it started (see track_starts)
_STARTED_IN: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
_running_test = [""]


def track_starts() -> None:
    """From now on, remember which test each thread was started in (named in a failure)."""
    start = threading.Thread.start

    def tracked(thread: threading.Thread) -> None:
        _STARTED_IN[thread] = _running_test[0]
        start(thread)

    threading.Thread.start = tracked  # type: ignore[method-assign,assignment]


def running_test(nodeid: str) -> None:
    _running_test[0] = nodeid


def alive_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def leftover_threads(before: set[threading.Thread], *, settle: float = 5.0) -> list[str]:
    """Threads started since ``before`` that are still alive once ``settle`` seconds have
    passed for them to finish (a closed pool's workers take a moment to exit); each as
    ``name (daemon)`` or ``name``."""
    deadline = time.monotonic() + settle
    while True:
        left = sorted((t for t in alive_threads() - before
                       if not t.name.startswith(SESSION_PREFIX)), key=lambda t: t.name)
        if not left or time.monotonic() >= deadline:
            return [f"{t.name}{' (daemon)' if t.daemon else ''}, started in "
                    f"{_STARTED_IN.get(t) or 'an unknown test'}" for t in left]
        time.sleep(0.05)
