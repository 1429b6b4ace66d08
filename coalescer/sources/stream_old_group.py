"""After an upgrade: the group ``coalescer`` (earlier releases' default for every
namespace) still holding entries on a stream whose source now reads in the group its
namespace gives it. Logged once, when the source creates its new group: those entries
are not read by the new group (``group: coalescer`` in the source keeps reading them).
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import ResponseError

from coalescer.config.sources import OLD_DEFAULT_GROUP, StreamSource, default_group

log = logging.getLogger("coalescer.sources.streams")


async def warn_old_group(client: Any, source: StreamSource, namespace: str) -> None:
    """A warning when ``source`` reads in its namespace's default group and the old
    default group of its stream has pending or unread entries."""
    if source.group != default_group(namespace, source.name):
        return
    try:
        groups = await client.xinfo_groups(source.stream)
    except ResponseError:
        return
    for group in groups:
        name = group.get("name", group.get(b"name"))
        name = name.decode() if isinstance(name, bytes) else name
        if name != OLD_DEFAULT_GROUP:
            continue
        pending = int(group.get("pending", group.get(b"pending")) or 0)
        lag = group.get("lag", group.get(b"lag"))
        unread = int(lag) if lag is not None else 0
        if pending or unread:
            log.warning("source %s: the group %r of stream %r (the default group before "
                        "namespaces named groups) still holds %d pending and %d unread "
                        "entries, which this source's group %r does not read; to read "
                        "them, set group: %s in the source", source.name,
                        OLD_DEFAULT_GROUP, source.stream, pending, unread, source.group,
                        OLD_DEFAULT_GROUP)
