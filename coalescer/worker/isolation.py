"""``isolation: process``: a rule's sync handler runs in child processes of the node.

Each such rule has a pool of at most ``concurrency`` children (forked by
multiprocessing's fork server, each importing the handler once, see
``worker.child``), reused from one run to the next. A run whose task is cancelled
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
import logging
import multiprocessing
import pickle
from collections.abc import Awaitable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from coalescer.worker.child import Packed, serve
from coalescer.worker.invoke import RunCancelled

log = logging.getLogger(__name__)

STOP_WAIT = 0.5  # seconds from SIGTERM to SIGKILL
REAP_WAIT = 2.0  # seconds for a killed child to be gone
CONTEXT = "forkserver"


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
    """The child processes of one rule: at most ``size`` of them, started when needed."""

    def __init__(self, rule: str, ref: str, base_dir: Path | None, size: int) -> None:
        self._rule = rule
        self._ref = ref
        self._base_dir = str(base_dir) if base_dir is not None else None
        self._size = size
        self._idle: list[Child] = []
        self._children: set[Child] = set()
        self._context = multiprocessing.get_context(CONTEXT)
        # Forked from a server that imported this once (if it is not running yet).
        self._context.set_forkserver_preload([serve.__module__])

    async def call(self, arg: Any) -> object:
        """``handler(arg)`` in a child; RunCancelled (its stop in ``ends``) if cancelled."""
        child = self._idle.pop() if self._idle else self._launch()
        started = False
        try:
            if not child.ready:
                await self._ready(child)
            child.conn.send(arg)
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
            log.warning("rule %s: more than %d handler child processes at once", self._rule,
                        self._size)
        ours, theirs = self._context.Pipe()
        process = self._context.Process(  # type: ignore[attr-defined]
            target=serve, args=(theirs, self._ref, self._base_dir), daemon=True,
            name=f"coalescer-{self._rule}")
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
        log.debug("rule %s: handler child process %d ready", self._rule, child.process.pid)

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
            log.warning("rule %s: stopping a handler child process failed: %r", self._rule,
                        exc)
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
        log.info("rule %s: killed handler child process %d (exit code %s)", self._rule,
                 process.pid, process.exitcode)

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
