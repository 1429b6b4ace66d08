"""gunicorn settings of the example:

    gunicorn -c examples/sync_app/gunicorn.conf.py examples.sync_app.app:app

It binds 127.0.0.1, port ``$PORT``, else 8000 (gunicorn logs "Listening at: ..."; ``--bind``
and ``--workers`` on the command line override these).

No ``post_fork`` hook is needed: the SyncCoalescer the master started at import
starts again by itself on its first touch in each worker. (To connect before a
worker's first request instead, a ``post_fork`` hook may call ``coalescer.start()``;
in a forked child it leaves the master's loop and connections alone.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

bind = f"127.0.0.1:{os.environ.get('PORT') or 8000}"
workers = 2
preload_app = True  # the app (and its SyncCoalescer) is imported once, in the master

log = logging.getLogger("gunicorn.error")


def worker_exit(server: Any, worker: Any) -> None:
    """A touch waits in the worker for up to ``absorb`` (50 ms) before it is written to
    Redis: close() writes what is left, so a worker that is stopped or recycled
    (``max_requests``) loses no touch."""
    from examples.sync_app.app import coalescer

    coalescer.close()
    log.info("worker %s: coalescer closed, every touch written to Redis", worker.pid)


def on_exit(server: Any) -> None:
    from examples.sync_app.app import coalescer

    coalescer.close()
