"""The node's process pool: sync handlers (the default, ``isolation: process``) run in
child processes of the node.

One pool per node, shared by its rules: at most the sum of their ``concurrency``
children, started when a run finds none idle and reused by any rule's next run (a
child runs one handler at a time, see ``worker.child``). Children are forked by
multiprocessing's fork server, which imported the rules' handlers first
(``worker.fork_preload``) so that they share those pages; each dies with the node
(``worker.node_death``). A run whose task is cancelled
(its timeout, its claim lost, the end of the shutdown grace) kills its child:
SIGTERM, then SIGKILL ``STOP_WAIT`` seconds later if it is still there, and the
invoker's cancellation carries the stop, so the runner keeps the run's slot until the
child is gone. A killed (or crashed) child is replaced by a new one at a later run.
An exception raised in the child is raised again in the node, with the child's
traceback as a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from coalescer.worker import fork_preload
from coalescer.worker.child import Packed, serve
from coalescer.worker.invoke import Invoke, RunCancelled

log = logging.getLogger(__name__)

STOP_WAIT = 0.5  # seconds from SIGTERM to SIGKILL
REAP_WAIT = 2.0  # seconds for a killed child to be gone
CONTEXT = "forkserver"
HandlerRef = tuple[str, "str | None"]  # (module:function, the folder it imports from)


def start_fork_server(handlers: Sequence[HandlerRef], first: Sequence[str] = ()) -> None:
    """Start the fork server now, having ``first`` then the ``handlers`` imported,
    unless it runs. Started from the main thread, it dies with this process (the
    kernel's parent-death signal follows the thread that started it: from another
    thread, it is not armed, and the server ends once its children have)."""
    context = multiprocessing.get_context(CONTEXT)
    context.set_forkserver_preload([*first, serve.__module__, fork_preload.__name__])
    node = os.getpid() if threading.current_thread() is threading.main_thread() else None
    plan = json.dumps({"node": node, "handlers": [list(h) for h in handlers]})
    before = os.environ.get(fork_preload.ENV)
    os.environ[fork_preload.ENV] = plan
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[fork_preload.ENV]
        else:
            os.environ[fork_preload.ENV] = before


def _forget_fork_server() -> None:
    """In a process forked (``os.fork``) from one that had started the fork server: that
    server is its parent's, not this process's child; the next pool starts its own.
    (multiprocessing keeps the server's pid, address and alive pipe in a module-level
    object that a fork copies as it is.)"""
    server: Any = vars(multiprocessing.forkserver)["_forkserver"]
    alive = server._forkserver_alive_fd
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)  # the parent keeps its own
    server._lock = threading.Lock()  # held by another thread of the parent, maybe


os.register_at_fork(after_in_child=_forget_fork_server)


class ChildError(Exception):
    """An exception of the child that could not be sent back as itself."""


class ChildDied(Exception):
    """The child process ended during a run (it exited, or was killed from outside)."""


@dataclass(eq=False, slots=True)
class Child:
    """One child process and the node's end of its pipe."""

    process: BaseProcess
    conn: Connection
    ready: bool = False
    launched: asyncio.Future[None] | None = field(default=None)


def unpack(packed: Packed) -> Exception:
    """The exception the child sent, as itself when it unpickles (ChildError if not)."""
    blob, name, text, trace = packed
    exc: object = None
    if blob is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(blob)  # our own child's pipe
    if not isinstance(exc, Exception):  # BaseExceptions (SystemExit...) stay the child's
        exc = ChildError(f"{name}: {text}" if text else name)
    exc.add_note("raised in the handler's child process:\n" + trace.rstrip())
    return exc


class ChildPool:
    """The node's child processes: at most ``size`` of them, started when needed."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._idle: list[Child] = []
        self._children: set[Child] = set()
        self._context = multiprocessing.get_context(CONTEXT)

    def invoker(self, ref: str, base_dir: Path | None) -> Invoke:
        """What runs the handler ``ref`` (imported from ``base_dir``) in a child."""
        where = str(base_dir) if base_dir is not None else None

        async def call(arg: Any) -> object:
            return await self.call(ref, where, arg)
        return call

    async def call(self, ref: str, base_dir: str | None, arg: Any) -> object:
        """``handler(arg)`` in a child; RunCancelled (its stop in ``ends``) if cancelled."""
        child = self._idle.pop() if self._idle else self._launch()
        started = False
        try:
            if not child.ready:
                await self._ready(child)
            child.conn.send((ref, base_dir, arg))
            started = True
            kind, payload = await self._receive(child)
        except asyncio.CancelledError:
            why = "" if started else "its child process was not ready"
            raise RunCancelled(started=started, ends=self._stopping(child), why=why) from None
        except BaseException:
            self._stopping(child)
            raise
        self._idle.append(child)
        if kind == "error":
            raise unpack(payload)
        return payload

    def _launch(self) -> Child:
        if len(self._children) >= self._size:  # only past a bug in the slot counts
            log.warning("more than %d handler child processes at once", self._size)
        ours, theirs = self._context.Pipe()
        process = self._context.Process(  # type: ignore[attr-defined]
            target=serve, args=(theirs,), daemon=True, name="coalescer-handler")
        child = Child(process, ours)
        self._children.add(child)
        # Forking (and, the first time, the fork server's start) waits on a socket.
        child.launched = asyncio.ensure_future(asyncio.to_thread(self._start, child, theirs))
        return child

    @staticmethod
    def _start(child: Child, theirs: Connection) -> None:
        try:
            child.process.start()
        finally:
            theirs.close()  # the child holds its own copy

    async def _ready(self, child: Child) -> None:
        assert child.launched is not None
        await asyncio.shield(child.launched)
        kind, payload = await self._receive(child)
        if kind != "ready":
            raise unpack(payload)
        child.ready = True
        log.debug("handler child process %d ready", child.process.pid)

    async def _receive(self, child: Child) -> tuple[str, Any]:
        conn = child.conn
        if not conn.poll():
            await _readable(conn.fileno())
        try:
            reply: tuple[str, Any] = conn.recv()
        except EOFError:
            child.process.join(REAP_WAIT)
            raise ChildDied(f"the handler's child process {child.process.pid} ended "
                            f"(exit code {child.process.exitcode})") from None
        return reply

    def _stopping(self, child: Child) -> asyncio.Future[None]:
        """Stop ``child`` in the background; the future is done once it is gone."""
        return asyncio.ensure_future(self._stop(child))

    async def _stop(self, child: Child) -> None:
        try:
            await self._end(child)
        except Exception as exc:  # the child is killed below all the same
            log.warning("stopping a handler child process failed: %r", exc)
        finally:
            _kill(child)
            self._children.discard(child)

    async def _end(self, child: Child) -> None:
        """SIGTERM, then SIGKILL if ``child`` is still there ``STOP_WAIT`` seconds later."""
        process = child.process
        if child.launched is not None:
            with contextlib.suppress(Exception):  # its failure was the run's
                await asyncio.shield(child.launched)
        if process.pid is None or process.exitcode is not None:
            return
        process.terminate()
        if not await _exited(process, STOP_WAIT):
            process.kill()
            await _exited(process, REAP_WAIT)
        log.info("killed handler child process %d (exit code %s)", process.pid,
                 process.exitcode)

    def close(self) -> None:
        """Kill every child now (SIGKILL: the grace is over) and reap it. Idempotent."""
        children, self._children, self._idle = self._children, set(), []
        for child in children:
            _kill(child)


def _kill(child: Child) -> None:
    child.conn.close()
    process = child.process
    if process.pid is None:
        return
    if process.exitcode is None:
        process.kill()
    process.join(REAP_WAIT)


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _settle, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _exited(process: BaseProcess, timeout: float) -> bool:
    """Whether ``process`` ended within ``timeout`` seconds (its sentinel became readable)."""
    waiting: Awaitable[None] = _readable(process.sentinel)
    try:
        await asyncio.wait_for(waiting, timeout)
    except TimeoutError:
        return False
    process.join(0)
    return True
