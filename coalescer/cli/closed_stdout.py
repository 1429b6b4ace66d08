"""A command whose reader went away (``coalescer history | head -1``) ends quietly, as
``yes | head -1`` does: nothing on stderr, exit status 141 (128 + SIGPIPE)."""

from __future__ import annotations

import os
import select
import sys

EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell shows for a writer its reader left


def stdout_closed() -> bool:
    """True when stdout is a pipe whose reading end is closed (a broken pipe elsewhere,
    a socket, is an error to report)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def leave_quietly() -> int:
    """Point stdout at /dev/null (so the interpreter's last flush does not fail too)
    and return the exit status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_STDOUT_CLOSED
