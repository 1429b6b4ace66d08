"""Fork safety: a forked child never uses, closes or collects what its parent owns.

After ``fork()`` the child holds copies of the parent's event loop, its epoll instance
and its Redis sockets, but none of its threads; it *parks* them (keeps a reference and
never touches them again) until it exits. Why, and what a child made from C without
Python's fork hooks needs (``repair_after_foreign_fork()``, which runs
``PyOS_AfterFork_Child()`` while the calling thread is the process's only one): docs/
operations.md, "Forking servers". (The hang it avoids: a thread of the parent waiting
for the GIL at the fork leaves the child's GIL condition variable counting a waiter that
does not exist, and the first hand-over between two of the child's threads blocks both.)

Objects that hold such resources register with ``track()``; in a forked child their
``after_fork()`` runs at once, from ``os.register_at_fork``. That hook costs nothing on
the hot path; ``os.getpid()`` is a system call, so it is checked only on the slow paths
(start, flush) for forks made without the hook.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import Any, Protocol

log = logging.getLogger(__name__)


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """Forget, without closing, what the parent process owns."""


_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_parked: list[object] = []
_whole = {"pid": os.getpid()}  # the process whose interpreter state is known to be whole


def track(obj: ForkAware) -> None:
    """Call ``obj.after_fork()`` in every process forked from this one."""
    _tracked.add(obj)


def park(obj: object) -> None:
    """Keep ``obj`` alive, unused, for the rest of this process (see the module doc)."""
    _parked.append(obj)


def repair_after_foreign_fork() -> bool:
    """In a child forked without Python's hooks, run the interpreter's after-fork
    repair now (see the module doc); returns whether it ran. A no-op elsewhere."""
    pid, parent = os.getpid(), _whole["pid"]
    if pid == parent:
        return False
    _whole["pid"] = pid
    threads = _os_threads()
    if threads != 1:
        log.warning("process %d was forked from %d without Python's fork hooks and has "
                    "%s threads: starting a coalescer thread here may hang on the GIL; "
                    "fork with os.fork() (uwsgi: py-call-osafterfork)", pid, parent,
                    "unknown" if threads is None else threads)
        return False
    ctypes.pythonapi.PyOS_AfterFork_Child()  # GIL held: pythonapi is a PyDLL
    log.info("process %d: forked without Python's fork hooks; ran them now", pid)
    return True


def _os_threads() -> int | None:
    """How many threads this process runs (threading's own count is the parent's after
    such a fork); None where the platform does not say."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _after_fork_in_child() -> None:
    _whole["pid"] = os.getpid()
    for obj in list(_tracked):
        obj.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
