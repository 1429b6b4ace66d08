"""Sources of touches besides ``touch()``: the ``Source`` interface and the registry of
source types (``base``), the Redis Streams source (``streams``, type ``stream``) and
the transactional outbox (``outbox``, type ``outbox``: rows of the application's
database, read with ``outbox_db``; its SQL in ``outbox_sql``) and Kafka topics
(``kafka``, type ``kafka``; what a message touches in ``kafka_values``).

Adding a source type means three things:

1. implement ``base.Source`` (start, stop) in a module under ``coalescer/sources/``,
   with a function that opens it for a node's sources of the type and one that reads
   what ``coalescer status`` shows of one of them;
2. register it by its ``type:`` name: ``base.register(SourceType(name=..., open=...,
   status=...))`` when the module is imported, and import the module below;
3. add its config fields: a ``SourceConfig`` subclass and its reader in
   ``coalescer/config/sources.py``, registered in ``SOURCE_TYPES`` there by the same
   name (the rules file refuses a ``type:`` it does not know).

May import ``coalescer.write``, ``coalescer.store``, ``coalescer.config`` and
``coalescer.common``.
"""

from __future__ import annotations

from coalescer.sources import (
    kafka,  # registers the "kafka" type
    outbox,  # registers the "outbox" type
    streams,  # registers the "stream" type
)

__all__ = ["kafka", "outbox", "streams"]
