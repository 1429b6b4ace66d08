"""Imported by the fork server of the handlers' child processes, and only there (the
node names it in the fork server's preload): it imports the handlers the node named
(so the children forked from the server share those pages instead of each importing
them again), arms the server to die with its node (``node_death``; when the node
started it from its main thread: the signal follows the thread), and freezes what
is allocated so far out of the garbage collector's reach (a collection in a child then
never writes to, and so never copies, the pages it shares with the server).

A handler that fails to import here is left to fail again, with its cause, in the
child that runs it (the node reports it on the rule's runs).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

from coalescer.config.handler_import import HandlerImport, resolve
from coalescer.worker.node_death import die_with_parent

ENV = "COALESCER_FORK_PRELOAD"  # {"node": pid or null, "handlers": [[ref, base_dir], ...]}


def _preload() -> None:
    raw = os.environ.get(ENV)
    if raw is None:
        return
    plan = json.loads(raw)
    for ref, base_dir in plan.get("handlers", []):
        spec = HandlerImport(ref=ref, file="<rules>", line=0, field="handler",
                             base_dir=Path(base_dir) if base_dir is not None else None)
        with contextlib.suppress(BaseException):  # reported by the child that runs it
            resolve(spec)
    if plan.get("node") is not None:  # started from the node's main thread
        die_with_parent(int(plan["node"]))
    gc.collect()
    gc.freeze()


_preload()
