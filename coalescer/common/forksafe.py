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
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol


class ForkAware(Protocol):
    def after_fork(self) -> None:
        """Forget, without closing, what the parent process owns."""


_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_parked: list[object] = []


def track(obj: ForkAware) -> None:
    """Call ``obj.after_fork()`` in every process forked from this one."""
    _tracked.add(obj)


def park(obj: object) -> None:
    """Keep ``obj`` alive, unused, for the rest of this process (see the module doc)."""
    _parked.append(obj)


def _after_fork_in_child() -> None:
    for obj in list(_tracked):
        obj.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
