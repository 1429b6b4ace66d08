"""Threads that outlive what started them: the suite checks each test module for them.

A thread still alive after its test module ended is a connection, a pool or a source
someone forgot to close; a non-daemon one also keeps the test process from exiting.
"""

from __future__ import annotations

import threading
import time

# Threads a session fixture starts (once, in whichever module first needs it) and stops
# at the end of the session: named with this prefix.
SESSION_PREFIX = "session-"


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
            return [f"{t.name}{' (daemon)' if t.daemon else ''}" for t in left]
        time.sleep(0.05)
