"""What a handler's child process runs (the node's process pool): it arms its death
with the node's (``node_death``), says it is ready, then runs the calls it receives,
up to ``runs`` at once on threads of its own. The node sends lists of
``(id, ref, base_dir, claim or list of claims)``; for each, the child imports the
handler ``ref`` once (``module:function``, with the rules file's folder first on
``sys.path``, as the node does; usually already imported by the fork server) and
sends back ``(id, "ok", answer)`` or ``(id, "error", packed exception)``, several
replies to a message (``frame``) when they finish together. One child serves any rule's
handler.

The node kills the process at a run's timeout, when a run's claim is lost and at the
end of the shutdown grace (the child's other runs end with it: the node fails them,
and they are retried); the child itself never decides to stop but at the end of its
pipe (the node closed it) or at its node's death. It ignores SIGINT: a Ctrl-C in the
terminal reaches the whole process group, and it is the node's to handle (its first
one lets running refreshes finish).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from coalescer.config.handler_import import HandlerImport, resolve
from coalescer.worker.node_death import die_with_parent, exit_at_eof
from coalescer.worker.threads import HandlerThreads

# An exception as the child sends it: the pickled exception (None when it does not
# pickle), its type's name, its message and its formatted traceback.
Packed = tuple[bytes | None, str, str, str]
Request = tuple[int, str, "str | None", Any]  # (id, module:function, base_dir, arg)
Reply = tuple[int, str, Any]  # (id, "ok" | "error" | "ready", answer or Packed or pid)
Handler = Callable[[object], object]
FRAME = struct.Struct("!Q")


def pack(exc: BaseException) -> Packed:
    """``exc`` as it crosses the pipe (it may hold what does not pickle)."""
    trace = "".join(traceback.format_exception(exc))
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:  # any exception's own state may refuse
        blob = None
    return blob, type(exc).__name__, str(exc), trace


def frame(message: object) -> bytes:
    """A reply message as it crosses the pipe: its pickle's length (8 bytes, big-endian),
    then the pickle (the node reads every frame that has come at once, see
    ``worker.isolation``)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(payload)) + payload


class _Replies:
    """Sends replies from any thread: one sender at a time, taking every reply that
    came meanwhile into its message."""

    def __init__(self, conn: Connection) -> None:
        self._socket = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()
        self._waiting: list[Reply] = []
        self._sending = False

    def send(self, reply: Reply) -> None:
        with self._lock:
            self._waiting.append(reply)
            if self._sending:
                return
            self._sending = True
        while True:
            with self._lock:
                batch, self._waiting = self._waiting, []
                if not batch:
                    self._sending = False
                    return
            try:
                self._socket.sendall(frame(batch))
            except OSError:  # the node closed the pipe: it is stopping this process
                os._exit(1)


class _Runs:
    """Runs requests on up to ``size`` threads (``HandlerThreads``), each handler
    imported once."""

    def __init__(self, size: int, replies: _Replies) -> None:
        self._threads = HandlerThreads("run", size)
        self._replies = replies
        self._lock = threading.Lock()
        self._handlers: dict[tuple[str, str | None], Handler] = {}

    def submit(self, request: Request) -> None:
        self._threads.submit(self._run, request)

    def _run(self, request: Request) -> None:
        run_id, ref, base_dir, arg = request
        try:
            handler = self._handler(ref, base_dir)
        except BaseException as exc:  # sent to the node, which reports it
            self._replies.send((run_id, "error", pack(exc)))
        else:
            self._replies.send((run_id, *_call(handler, arg)))

    def _handler(self, ref: str, base_dir: str | None) -> Handler:
        found = self._handlers.get((ref, base_dir))
        if found is None:
            with self._lock:  # one import at a time (sys.modules and sys.path)
                found = self._handlers.get((ref, base_dir))
                if found is None:
                    found = self._handlers[(ref, base_dir)] = _resolve(ref, base_dir)
        return found


def serve(conn: Connection, runs: int = 1, environ: dict[str, str] | None = None) -> None:
    """The child's main function: arm its death, say ready, run calls (up to ``runs``
    at once) until the pipe ends. ``environ``: the node's environment when it started
    the child (the fork server's is the one it had at its own start)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(os.getppid())  # the fork server (a node's own fork, if any other)
    node = multiprocessing.parent_process()
    if node is not None:
        exit_at_eof(node.sentinel)
    replies = _Replies(conn)
    replies.send((0, "ready", os.getpid()))
    pool = _Runs(runs, replies)
    while True:
        try:
            requests: list[Request] = conn.recv()
        except (EOFError, OSError):
            break
        for request in requests:
            pool.submit(request)
    for stream in (sys.stdout, sys.stderr):  # what the handlers printed
        if stream is not None:
            stream.flush()
    os._exit(0)  # runs still going (threads) end with it: the node is done with them


def _resolve(ref: str, base_dir: str | None) -> Handler:
    _forget_foreign(ref.partition(":")[0].partition(".")[0], base_dir)
    spec = HandlerImport(ref=ref, file="<rules>", line=0, field="handler",
                         base_dir=Path(base_dir) if base_dir is not None else None)
    handler: Handler = resolve(spec)
    return handler


def _call(handler: Handler, arg: object) -> tuple[str, object]:
    try:
        answer = handler(arg)
    except BaseException as exc:  # the handler's failure is data
        return "error", pack(exc)
    if answer is None:
        return "ok", None
    try:
        pickle.dumps(answer)
    except Exception as exc:
        problem = TypeError(f"the handler's answer ({type(answer).__name__}) cannot be sent "
                            f"from its child process: {exc}")
        return "error", pack(problem)
    return "ok", answer
def _forget_foreign(top: str, base_dir: str | None) -> None:
    """Drop the module ``top`` (and its submodules) the fork server imported from
    another folder than ``base_dir`` when ``base_dir`` has one of that name: the rules
    file's folder comes first, as in the node (another rules file of the same process
    may have had its own module of that name imported first)."""
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if base_dir is None or not isinstance(file, str):
        return
    folder = Path(base_dir)
    if Path(file).is_relative_to(folder):
        return
    if (folder / f"{top}.py").exists() or (folder / top).is_dir():
        for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
            del sys.modules[name]
