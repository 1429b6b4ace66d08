"""Forking in tests: a child that runs a body and reports by its exit code, waited for
with a bound; libc's fork(), which skips Python's fork hooks, as some servers' masters do."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tests.helpers.servers import poll_until

LIBC_FORK: Callable[[], int] = ctypes.PyDLL(None).fork  # PyDLL: the GIL stays held
ROOT = Path(__file__).resolve().parents[2]


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


def exit_code_in_fresh_interpreter(scenario: Callable[..., int], *args: str,
                                   timeout: float = 90.0) -> int:
    """Run the module-level ``scenario(*args)`` in a new interpreter and return what it
    returns.

    A libc fork copies every lock held by another thread at that instant, and a test
    worker runs threads of its own (and leftovers of earlier tests) that log: a child that
    logs before its repair could wait forever. A fresh interpreter has only its own. It
    runs in a process group of its own, killed whole past ``timeout`` (longer than the
    scenario's own wait for its child), so no child it forked outlives the test."""
    code = (f"import sys\nfrom {scenario.__module__} import {scenario.__name__} as scenario\n"
            "sys.exit(scenario(*sys.argv[1:]))\n")
    with subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            print(output)
            raise
    if proc.returncode:
        print(output)  # shown by pytest when the test fails
    return proc.returncode
