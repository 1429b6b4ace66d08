"""When a worker node begins a reshard: its rules file names another shard count than
the namespace's layout (see store/layout.py).

A node that starts with a new ``shards`` value begins the reshard; nodes still on
the old file follow the layout in Redis, whatever their file says. So that a node
restarted with the old file during a rolling deploy does not undo the change, a
node whose file names the count the running (or last) reshard came from follows it
with a warning instead of beginning another; so does any node while a reshard runs.
"""

from __future__ import annotations

import logging

from coalescer.store.layout import Layouts

log = logging.getLogger(__name__)


async def begin_reshard(layouts: Layouts, wanted: int, node_id: str) -> bool:
    """Begin a reshard to ``wanted`` shards if this node should (see the module);
    True if this call began one."""
    info = layouts.info
    if info.resharding:
        if wanted not in (info.shards, info.source):
            _follow(node_id, wanted, info.shards, f"a reshard from {info.source} runs")
        return False
    if wanted == info.was:
        _follow(node_id, wanted, info.shards,
                f"resharded from {info.was}, the count this file names")
        return False
    began = await layouts.begin(wanted, node_id)
    info = layouts.info
    if began:
        await layouts.raise_markers()
        log.info("node %s: resharding from %d to %d shards: the old shards' leaders move "
                 "their keys, touches keep working", node_id, info.source, info.shards)
    return began


def _follow(node_id: str, wanted: int, shards: int, why: str) -> None:
    log.warning("node %s: its rules file says shards: %d, the namespace has %d (%s): this "
                "node follows the namespace", node_id, wanted, shards, why)
