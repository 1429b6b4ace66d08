"""What a handler's child process runs (the node's process pool): it arms its death
with the node's (``node_death``), says it is ready, then for each call it receives,
``(ref, base_dir, claim or list of claims)``, imports the handler ``ref`` once
(``module:function``, with the rules file's folder first on ``sys.path``, as the node
does; usually already imported by the fork server) and sends back ``("ok", answer)``
or ``("error", packed exception)``. One child serves any rule's handler, one run at a
time.

The node kills the process at the run's timeout, when its claim is lost and at the
end of the shutdown grace; the child itself never decides to stop but at the end of
its pipe (the node closed it) or at its node's death. It ignores SIGINT: a Ctrl-C in
the terminal reaches the whole process group, and it is the node's to handle (its
first one lets running refreshes finish).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from coalescer.config.handler_import import HandlerImport, resolve
from coalescer.worker.node_death import die_with_parent, exit_at_eof

# An exception as the child sends it: the pickled exception (None when it does not
# pickle), its type's name, its message and its formatted traceback.
Packed = tuple[bytes | None, str, str, str]


def pack(exc: BaseException) -> Packed:
    """``exc`` as it crosses the pipe (it may hold what does not pickle)."""
    trace = "".join(traceback.format_exception(exc))
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:  # any exception's own state may refuse
        blob = None
    return blob, type(exc).__name__, str(exc), trace


def serve(conn: Connection) -> None:
    """The child's main function: arm its death, say ready, run calls until the pipe
    ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(os.getppid())  # the fork server (a node's own fork, if any other)
    node = multiprocessing.parent_process()
    if node is not None:
        exit_at_eof(node.sentinel)
    conn.send(("ready", os.getpid()))
    handlers: dict[tuple[str, str | None], Callable[[object], object]] = {}
    while True:
        try:
            ref, base_dir, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            handler = _handler(handlers, ref, base_dir)
        except BaseException as exc:  # sent to the node, which reports it
            conn.send(("error", pack(exc)))
            continue
        conn.send(_call(handler, arg))


def _handler(handlers: dict[tuple[str, str | None], Callable[[object], object]], ref: str,
             base_dir: str | None) -> Callable[[object], object]:
    found = handlers.get((ref, base_dir))
    if found is None:
        _forget_foreign(ref.partition(":")[0].partition(".")[0], base_dir)
        spec = HandlerImport(ref=ref, file="<rules>", line=0, field="handler",
                             base_dir=Path(base_dir) if base_dir is not None else None)
        found = handlers[(ref, base_dir)] = resolve(spec)
    return found


def _call(handler: object, arg: object) -> tuple[str, object]:
    try:
        answer = handler(arg)  # type: ignore[operator]
    except BaseException as exc:  # the handler's failure is data
        return "error", pack(exc)
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
