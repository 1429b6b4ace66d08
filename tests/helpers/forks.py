"""Forking in tests: a child that runs a body and reports by its exit code, waited for
with a bound; libc's fork(), which skips Python's fork hooks, as some servers' masters do."""

from __future__ import annotations

import ctypes
import os
import signal
import traceback
from collections.abc import Callable

from tests.helpers.servers import poll_until

LIBC_FORK: Callable[[], int] = ctypes.PyDLL(None).fork  # PyDLL: the GIL stays held


def in_child(body: Callable[[], None], fork: Callable[[], int] = os.fork) -> int:
    """Fork; the child runs ``body`` and exits 0, or 1 with a traceback if it raised."""
    pid = fork()
    if pid:
        return pid
    code = 1
    try:
        body()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def exit_code(pid: int, timeout: float = 60.0) -> int:
    """Wait, bounded, for child ``pid``; kill it if it outlives ``timeout``."""
    def reaped() -> tuple[int] | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return (os.waitstatus_to_exitcode(status),) if done else None
    try:
        code: int = poll_until(reaped, timeout, message=f"child {pid} to exit")[0]
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return code


def child_exit_code(body: Callable[[], None], fork: Callable[[], int]) -> int:
    """Fork with ``fork``, run ``body`` in the child and return its exit code."""
    return exit_code(in_child(body, fork))
