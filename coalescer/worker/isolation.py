"""The node's process pool: sync handlers (the default, ``isolation: process``) run in
child processes of the node: one pool per node, shared by its rules, ``RUNS_PER_CHILD``
runs a child on threads of its own (``worker.child``); how runs are placed, stopped and
what a stopped run costs its child's others: docs/rules.md, "Where a plain function
runs: isolation".

Requests and replies cross one pipe per child, tagged with the run's id, several to a
message when they come together. Children are forked by multiprocessing's fork server,
which imported the rules' handlers first (``worker.fork_preload``) so that they share
those pages; each dies with the node (``worker.node_death``). A run whose task is
cancelled kills its child (SIGTERM, then SIGKILL ``STOP_WAIT`` seconds later), and the
invoker's cancellation carries the stop, so the runner keeps the run's slot until the
child is gone. An exception raised in the child is raised again in the node, with the
child's traceback as a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import socket
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from coalescer.worker import fork_preload
from coalescer.worker.child import FRAME, Packed, Request, serve
from coalescer.worker.invoke import Invoke, RunCancelled

log = logging.getLogger(__name__)

STOP_WAIT = 0.5  # seconds from SIGTERM to SIGKILL
REAP_WAIT = 2.0  # seconds for a killed child to be gone
READ_SIZE = 1 << 18  # bytes read from a child's pipe at a time, at most
RUNS_PER_CHILD = 10  # runs a child runs at once (on its threads), at most
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
    """The child process ended during a run (it exited, was killed from outside, or was
    stopped for another of its runs)."""


@dataclass(eq=False, slots=True)
class Child:
    """One child process, the node's end of its pipe and the runs it was sent."""

    process: BaseProcess
    conn: Connection
    ready: asyncio.Future[None]
    replies: Frames
    load: int = 0  # runs given to it (sent, or waiting for it to be ready)
    pending: dict[int, asyncio.Future[tuple[str, Any]]] = field(default_factory=dict)
    outbox: list[Request] = field(default_factory=list)  # sent at the loop's next turn
    stopping: asyncio.Future[None] | None = None  # done once it is gone
    death: str = ""  # why its runs failed, once it is stopping


class Frames:
    """Reads a child's reply messages (``child.frame``) off the node's end of its pipe
    without blocking: every one that has come, in one read."""

    def __init__(self, conn: Connection) -> None:
        self._socket = socket.socket(fileno=os.dup(conn.fileno()))
        self._buffer = bytearray()

    def read(self) -> list[Any]:
        """The messages complete so far (none yet: []); EOFError at the pipe's end."""
        try:
            data = self._socket.recv(READ_SIZE, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        if not data:
            raise EOFError
        buffer = self._buffer
        buffer += data
        messages, start = [], 0
        while len(buffer) - start >= FRAME.size:
            end = start + FRAME.size + FRAME.unpack_from(buffer, start)[0]
            if len(buffer) < end:
                break
            messages.append(pickle.loads(buffer[start + FRAME.size:end]))  # our child's
            start = end
        del buffer[:start]
        return messages

    def close(self) -> None:
        self._socket.close()


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
    """The node's child processes: at most ``ceil(size / per_child)`` of them, started
    when needed, each running up to ``per_child`` runs at once."""

    def __init__(self, size: int, per_child: int = RUNS_PER_CHILD) -> None:
        self._per_child = max(1, min(per_child, size))
        self._most = -(-size // self._per_child)
        self._live: list[Child] = []  # not stopping
        self._children: set[Child] = set()  # every one not yet reaped
        self._ids = itertools.count(1)
        self._context = multiprocessing.get_context(CONTEXT)

    @property
    def per_child(self) -> int:
        """How many runs a child runs at once, at most."""
        return self._per_child

    def invoker(self, ref: str, base_dir: Path | None) -> Invoke:
        """What runs the handler ``ref`` (imported from ``base_dir``) in a child."""
        where = str(base_dir) if base_dir is not None else None

        async def call(arg: Any) -> object:
            return await self.call(ref, where, arg)
        return call

    async def call(self, ref: str, base_dir: str | None, arg: Any) -> object:
        """``handler(arg)`` in a child; RunCancelled (its stop in ``ends``) if cancelled:
        the child is killed, and its other runs fail with ChildDied."""
        child = self._pick()
        child.load += 1
        run_id = next(self._ids)
        request: Request = (run_id, ref, base_dir, arg)
        try:
            if not child.ready.done():
                await asyncio.shield(child.ready)
            child.ready.result()
            reply = child.pending[run_id] = asyncio.get_running_loop().create_future()
            self._send(child, request)
            kind, payload = await reply
        except asyncio.CancelledError:
            raise self._cancelled(child, request) from None
        finally:
            child.load -= 1
            child.pending.pop(run_id, None)
        if kind == "error":
            raise unpack(payload)
        return payload

    def _cancelled(self, child: Child, request: Request) -> RunCancelled:
        """The run of ``request`` was cancelled: unless it never reached the child, the
        child is killed."""
        if not child.ready.done() or child.ready.exception() is not None:
            if child.load <= 1 and not child.ready.done():  # no other run waits on it
                self._stopping(child, "was stopped before it was ready")
            return RunCancelled(started=False, ends=None,
                                why="its child process was not ready")
        if request in child.outbox:  # not sent yet
            child.outbox.remove(request)
            return RunCancelled(started=False, ends=None, why="it was not sent to its child")
        key = getattr(request[3], "key", None)
        run = f"the run of {key}" if isinstance(key, str) else "a batch"
        return RunCancelled(started=True, ends=self._stopping(
            child, f"was stopped with {run} (its timeout or its claim lost)"))

    def _pick(self) -> Child:
        """An idle child, else a new one while there may be more, else the least
        loaded one with room."""
        idle = [c for c in self._live if c.load == 0]
        if idle:
            return max(idle, key=lambda c: c.ready.done())
        if len(self._live) < self._most:
            return self._launch()
        best = min(self._live, key=lambda c: c.load)
        if best.load >= self._per_child:  # only past a bug in the slot counts
            log.warning("more than %d runs at once in handler child processes",
                        self._most * self._per_child)
        return best

    def _send(self, child: Child, request: Request) -> None:
        child.outbox.append(request)
        if len(child.outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush, child)

    def _flush(self, child: Child) -> None:
        batch, child.outbox = child.outbox, []
        if not batch or child.stopping is not None:
            return
        try:
            child.conn.send(batch)
        except (OSError, ValueError):  # it died: its EOF is read next
            self._stopping(child, "")

    def _launch(self) -> Child:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(  # type: ignore[attr-defined]
            target=serve, args=(theirs, self._per_child, dict(os.environ)), daemon=True,
            name="coalescer-handler")
        child = Child(process, ours, asyncio.get_running_loop().create_future(),
                      Frames(ours))
        child.ready.add_done_callback(_retrieved)
        self._children.add(child)
        self._live.append(child)
        # Forking (and, the first time, the fork server's start) waits on a socket.
        launched = asyncio.ensure_future(asyncio.to_thread(self._start, child, theirs))
        launched.add_done_callback(lambda done: self._launched(child, done))
        return child

    @staticmethod
    def _start(child: Child, theirs: Connection) -> None:
        try:
            child.process.start()
        finally:
            theirs.close()  # the child holds its own copy

    def _launched(self, child: Child, done: asyncio.Future[None]) -> None:
        if child.stopping is not None:
            return
        error = None if done.cancelled() else done.exception()
        if error is not None or done.cancelled():
            self._stopping(child, "")
            return
        asyncio.get_running_loop().add_reader(child.conn.fileno(), self._readable, child)

    def _readable(self, child: Child) -> None:
        """Replies (or the end of the pipe) from ``child``: each settles its run."""
        try:
            for message in child.replies.read():
                for run_id, kind, payload in message:
                    self._settle(child, run_id, kind, payload)
        except (EOFError, OSError):
            self._stopping(child, "")

    def _settle(self, child: Child, run_id: int, kind: str, payload: Any) -> None:
        if kind == "ready":
            if not child.ready.done():
                child.ready.set_result(None)
                log.debug("handler child process %d ready", payload)
            return
        reply = child.pending.get(run_id)
        if reply is not None and not reply.done():
            reply.set_result((kind, payload))

    def _stopping(self, child: Child, death: str) -> asyncio.Future[None]:
        """Stop ``child`` in the background (once); the future is done once it is gone,
        and its runs fail then (``death`` says why; by default, that it ended)."""
        if child.stopping is None:
            child.death = death
            with contextlib.suppress(ValueError):
                self._live.remove(child)
            with contextlib.suppress(OSError, ValueError):
                asyncio.get_running_loop().remove_reader(child.conn.fileno())
            child.stopping = asyncio.ensure_future(self._stop(child))
        return child.stopping

    async def _stop(self, child: Child) -> None:
        try:
            await self._end(child)
        except Exception as exc:  # the child is killed below all the same
            log.warning("stopping a handler child process failed: %r", exc)
        finally:
            _kill(child)
            self._children.discard(child)
            _fail(child)

    async def _end(self, child: Child) -> None:
        """SIGTERM, then SIGKILL if ``child`` is still there ``STOP_WAIT`` seconds later."""
        process = child.process
        if process.pid is None or process.exitcode is not None:
            return
        if not child.death and await _exited(process, REAP_WAIT):  # it ended by itself
            return
        process.terminate()
        if not await _exited(process, STOP_WAIT):
            process.kill()
            await _exited(process, REAP_WAIT)
        log.info("killed handler child process %d (exit code %s)", process.pid,
                 process.exitcode)

    def close(self) -> None:
        """Kill every child now (SIGKILL: the grace is over) and reap it. Idempotent."""
        children, self._children, self._live = self._children, set(), []
        for child in children:
            if child.stopping is None:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(child.conn.fileno())
            child.death = child.death or "the node stopped"
            _kill(child)
            _fail(child)


def _fail(child: Child) -> None:
    """The runs still waiting on ``child``, which is gone, fail with ChildDied."""
    process = child.process
    text = (f"the handler's child process {process.pid} {child.death}" if child.death else
            f"the handler's child process {process.pid} ended "
            f"(exit code {process.exitcode})")
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
        if not child.ready.done():
            child.ready.set_exception(ChildDied(text))
        for reply in child.pending.values():
            if not reply.done():
                reply.set_exception(ChildDied(text))


def _retrieved(future: asyncio.Future[None]) -> None:
    """Marks the exception of a child's readiness seen (its runs report it)."""
    if not future.cancelled():
        future.exception()


def _kill(child: Child) -> None:
    child.conn.close()
    child.replies.close()
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
