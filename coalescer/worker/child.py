"""What a child process of ``isolation: process`` runs: it imports the rule's handler
(``module:function``, with the rules file's folder first on ``sys.path``, as the node
does), says it is ready, then calls the handler with each claim (or list of claims)
it receives and sends back ``("ok", answer)`` or ``("error", packed exception)``.

The node kills the process at the run's timeout, when its claim is lost and at the
end of the shutdown grace; the child itself never decides to stop but at the end of
its pipe (the node closed it). It ignores SIGINT: a Ctrl-C in the terminal reaches the
whole process group, and it is the node's to handle (its first one lets running
refreshes finish).
"""

from __future__ import annotations

import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from coalescer.config.handler_import import HandlerImport, resolve

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


def serve(conn: Connection, ref: str, base_dir: str | None) -> None:
    """The child's main function: import, say ready, run calls until the pipe ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = HandlerImport(ref=ref, file="<rules>", line=0, field="handler",
                         base_dir=Path(base_dir) if base_dir is not None else None)
    try:
        handler = resolve(spec)
    except BaseException as exc:  # sent to the node, which reports it
        conn.send(("error", pack(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            arg = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_call(handler, arg))


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
