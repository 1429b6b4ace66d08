"""A Flask app that touches a key on every write, served by gunicorn with --preload:

    gunicorn -c examples/sync_app/gunicorn.conf.py examples.sync_app.app:app

The ``SyncCoalescer`` is created and started at import, in the gunicorn master
(``--preload``), before the workers fork. That is safe: in each forked worker it
starts again by itself on first use, with its own event loop thread and Redis
connections (the parent's are never used, closed or collected by the child).
The same module works unchanged under ``flask run`` or without a fork at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flask import Flask, request

from coalescer import SyncCoalescer

from . import post_likes

RULES = Path(__file__).resolve().with_name("rules.yaml")

post_likes.init_db()
# worker=False: this process only touches; `coalescer run` nodes run the refreshes.
# The Redis URL: $COALESCER_REDIS_URL, else the project's embedded server.
coalescer = SyncCoalescer.from_yaml(RULES)
coalescer.start()

app = Flask(__name__)


@app.post("/posts/<int:post_id>/likes")
def like(post_id: int) -> tuple[dict[str, Any], int]:
    body = request.get_json(silent=True)
    user = body.get("user") if isinstance(body, dict) else None
    if not isinstance(user, str) or not user:
        return {"error": 'the body must be {"user": "<a non-empty name>"}'}, 400
    added = post_likes.add_like(post_id, user)
    if added:
        # After the commit (add_like has returned): a refresh that starts now sees it.
        coalescer.touch(post_likes.KEY_FORMAT.format(post_id))
    return {"post_id": post_id, "added": added, "worker": os.getpid()}, 201


@app.get("/posts/<int:post_id>")
def show(post_id: int) -> dict[str, Any]:
    """The count as last refreshed (null until the first refresh)."""
    return {"post_id": post_id, "likes": post_likes.read_count(post_id),
            "worker": os.getpid()}
