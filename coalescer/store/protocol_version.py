"""The touch protocol's version a namespace's keys follow (docs/protocol.md).

Every client that writes a namespace's keys, in any language, reads the version at
start from ``keys.protocol_version(namespace)``: absent, it writes its own
(``SET key VERSION NX``: the first one wins); present, it refuses to go on when the
major version is not one it speaks. Minor versions only add (an ARGV at the end of a
script, a new optional field), so any minor of a spoken major is accepted.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from redis.exceptions import RedisError

from coalescer.errors import ProtocolVersionError
from coalescer.store import keys

log = logging.getLogger(__name__)

MAJOR = 1
MINOR = 0
VERSION = f"{MAJOR}.{MINOR}"
_FORM = re.compile(r"^(\d{1,6})\.(\d{1,6})$")


def major_of(stored: str) -> int | None:
    """The major version of a stored ``MAJOR.MINOR`` text (None: not of that form)."""
    found = _FORM.match(stored)
    return int(found.group(1)) if found else None


def refusal(namespace: str, stored: str) -> ProtocolVersionError | None:
    """The error for a stored version this client cannot follow (None: it can)."""
    if major_of(stored) == MAJOR:
        return None
    where = keys.protocol_version(namespace)
    what = (f"version {stored}" if major_of(stored) is not None
            else f"an unreadable version {stored[:40]!r}")
    return ProtocolVersionError(
        f"namespace {namespace!r} follows touch protocol {what} (stored in {where}), "
        f"and this coalescer speaks version {VERSION}: its keys would be written in a "
        "form the others do not read; upgrade coalescer, or use another namespace",
        stored=stored, spoken=VERSION)


async def check(client: Any, namespace: str) -> str:
    """Read the namespace's version, writing ours when there is none; returns the
    version the namespace follows. ProtocolVersionError for a major we do not speak.
    A refused write (OOM, READONLY, ...) is only logged: the next client writes it."""
    key = keys.protocol_version(namespace)
    stored = await client.get(key)
    if stored is None:
        try:
            await client.set(key, VERSION, nx=True)
        except RedisError as exc:
            log.warning("could not write the touch protocol version to %s: %r", key, exc)
            return VERSION
        stored = await client.get(key)
        if stored is None:
            return VERSION
    text = stored.decode("utf-8", "replace") if isinstance(stored, bytes) else str(stored)
    wrong = refusal(namespace, text)
    if wrong is not None:
        raise wrong
    return text
