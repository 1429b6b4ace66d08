"""A running coalescer follows its embedded server when that server dies or is replaced.

The embedded server is shared by every command of a project; if it dies (killed, the
machine's OOM killer), the next command starts a replacement on the folder's socket. A
running writer or node would otherwise retry the dead server forever: this loop sees
that its server is gone (``EmbeddedServer.moved``: a dead process, or a record naming
another server), takes the server now serving the folder (``reacquire``: checked to
be ours before the password is sent; started if there is none), and points the
connection there. The buffered touches are written to it as soon as it answers.
"""

from __future__ import annotations

import asyncio
import logging

from coalescer.common.redact import redact
from coalescer.common.retrying import keep_running
from coalescer.store.connection import Connection
from coalescer.store.embedded import EmbeddedServer

log = logging.getLogger(__name__)

CHECK_EVERY = 1.0  # seconds between two looks at the embedded server's process and record


async def follow(embedded: EmbeddedServer, conn: Connection) -> None:
    """Run until cancelled: move ``conn`` to the server serving ``embedded``'s folder
    whenever the one it uses is gone."""

    async def step() -> None:
        if not embedded.moved():
            return
        log.error("the embedded server in %s is gone (its process died or it was "
                  "replaced); reconnecting to the one serving the folder", embedded.root)
        url = await asyncio.to_thread(embedded.reacquire)
        await conn.move_to(url)
        log.warning("reconnected to the embedded server in %s at %s", embedded.root,
                    redact(url))

    await keep_running("embedded server watch", step, logger=log,
                       rest=lambda: asyncio.sleep(CHECK_EVERY))
