"""Fork safety: a forked child never uses, closes or collects what its parent owns.

After ``fork()`` the child holds copies of the parent's event loop, its epoll
instance and its Redis sockets, but none of its threads. These are the parent's:
writing to a socket would interleave with the parent's commands, and even closing
one through asyncio (as redis-py's connection finalizer does when garbage
collected under a running loop) unregisters it from the epoll instance the two
processes share, so the parent stops hearing its replies. The child therefore
*parks* them: it keeps a reference for the rest of its life and never touches
them again. Their file descriptors close when the child exits.

Objects that hold such resources register with ``track()``; in a forked child
their ``after_fork()`` runs at once, from ``os.register_at_fork``. That hook costs
nothing on the hot path; ``os.getpid()`` is a system call, so it is checked only
on the slow paths (start, flush) for forks made without the hook.

A fork made from C without Python's hooks (libc ``fork()``, as uwsgi's master
does unless ``py-call-osafterfork`` is set) also skips the interpreter's own
repair of its state: the GIL, the thread states and the locks of threading,
logging and concurrent.futures stay as the parent's other threads had them. If
one of those threads was waiting for the GIL at the fork (the loop thread of a
started SyncCoalescer often is), the child's GIL condition variable counts a
waiter that does not exist, and the first time two threads of the child hand
the GIL over, both block inside it for good. ``repair_after_foreign_fork()``,
called before a coalescer starts a thread, detects such a fork by pid and runs
``PyOS_AfterFork_Child()`` there, the repair ``os.fork()`` would have run (it
also runs every ``os.register_at_fork`` hook, ours included). That is only safe
while the calling thread is the process's only one, so with other threads
already running it logs a warning and does nothing.

What it cannot repair is a child that hangs before it gets there: if the waiting
thread had also asked for the GIL to be handed over, the child's only thread
gives it up at its first chance and waits for a taker that never comes, before
any of our code runs. Only running ``PyOS_AfterFork_Child()`` right after the
fork avoids that (``os.fork()`` does; uwsgi with ``py-call-osafterfork``).
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
