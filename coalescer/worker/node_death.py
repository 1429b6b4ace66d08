"""How a handler's child process (and the fork server it comes from) dies with its node.

Two ways, both armed in the child: the kernel's parent-death signal (Linux's
``PR_SET_PDEATHSIG``: SIGKILL once the process that forked it is gone, even mid-run),
and, everywhere, a thread that waits on the end of a pipe only the node holds open
(multiprocessing's parent sentinel) and ends the process at its EOF. The fork server
arms the signal too when the node's main thread started it (the signal follows the
thread that forked), so a SIGKILLed node takes the fork server with it, and the fork
server its children; otherwise the server ends once its children have.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (``parent``, its pid now) dies; if it
    already has (a new parent adopted it), exit now. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def exit_at_eof(fd: int) -> None:
    """End this process (at once, no clean-up: its node is gone) once ``fd``, the read
    end of a pipe whose write end only the node holds, reaches EOF."""
    def watch() -> None:
        while True:
            with contextlib.suppress(InterruptedError):
                select.select([fd], [], [])
                break
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="coalescer-node-alive").start()
