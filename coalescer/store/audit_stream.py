"""The namespace's audit log: every operator action (who, what, when, how many) as an
entry of a capped Redis stream (``keys.audit_log``), written by ``AuditStream`` (the
sink ``common.audit_log.operator_action`` hands its entries to) and read newest first
by ``read_audit`` (``coalescer audit``, ``GET /audit``, the page).

An entry's fields: ``action``, ``target``, ``count`` (how many things it changed),
``who`` and ``detail`` (a bulk action's filters, say); its time is its stream id (the
server's clock). The stream keeps about ``MAXLEN`` entries (``XADD MAXLEN ~``): older
ones are trimmed. A write runs in the background of the action that made it and is
waited for when the coalescer closes; one that fails is logged and counted, never
raised (``common.audit_log.write_failed``).
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from coalescer.common.audit_log import AuditEntry, write_failed
from coalescer.store.keys import audit_log

MAXLEN = 10_000  # entries kept, about (XADD MAXLEN ~)
WRITE_TIMEOUT = 2.0  # seconds a write may take
MAX_READ = 1000  # entries one read returns at most
FIELD_BYTES = 1000  # a field's text is cut to this many characters
_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
QUEUED = 10_000  # entries waiting to be written at most (past it, the oldest are lost)


class AuditStream:
    """Writes a namespace's audit entries in order, one writer task at a time
    (``record`` never blocks); ``settle`` waits for the entries not yet written."""

    def __init__(self, redis: Any, namespace: str, *, maxlen: int = MAXLEN) -> None:
        self._redis = redis
        self._key = audit_log(namespace)
        self._maxlen = maxlen
        self._queue: deque[AuditEntry] = deque(maxlen=QUEUED)
        self._writer: asyncio.Task[None] | None = None

    def record(self, entry: AuditEntry) -> None:
        if len(self._queue) == self._queue.maxlen:
            write_failed(OverflowError(f"{QUEUED} audit entries waiting to be written"))
        self._queue.append(entry)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            await self._write(self._queue.popleft())

    async def _write(self, entry: AuditEntry) -> None:
        fields = {"action": entry.action, "target": entry.target[:FIELD_BYTES],
                  "count": str(entry.done), "who": entry.who[:FIELD_BYTES],
                  "detail": entry.detail[:FIELD_BYTES]}
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await self._redis.xadd(self._key, fields, maxlen=self._maxlen,
                                       approximate=True)
        except (RedisError, OSError, TimeoutError) as exc:
            write_failed(exc)

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout`` seconds) for the entries not yet written."""
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.wait([writer], timeout=timeout)


class Unwritable:
    """A sink with no connection: each entry is counted and logged as not written."""

    def __init__(self, why: str) -> None:
        self._why = why

    def record(self, entry: AuditEntry) -> None:
        write_failed(ConnectionError(f"{entry.action} {entry.target}: {self._why}"))


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """An entry as read back: its stream id, server time (ms) and fields."""

    id: str
    at_ms: int
    action: str
    target: str
    count: int
    who: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "at_ms": self.at_ms, "action": self.action,
                "target": self.target, "count": self.count, "who": self.who,
                "detail": self.detail}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _record(entry_id: Any, fields: dict[Any, Any]) -> AuditRecord:
    got = {_text(k): _text(v) for k, v in fields.items()}
    ident = _text(entry_id)
    count = got.get("count", "0")
    return AuditRecord(id=ident, at_ms=int(ident.split("-")[0]), action=got.get("action", ""),
                       target=got.get("target", ""),
                       count=int(count) if count.isdigit() else 0,
                       who=got.get("who", ""), detail=got.get("detail", ""))


async def read_audit(redis: Any, namespace: str, *, limit: int = 50,
                     before: str | None = None) -> list[AuditRecord]:
    """The newest ``limit`` entries (1 to MAX_READ), newest first, older than the entry
    id ``before`` when given (the next page: the last id of the page before)."""
    if isinstance(limit, bool) or not 1 <= limit <= MAX_READ:
        raise ValueError(f"the number of entries must be 1 to {MAX_READ}, got {limit!r}")
    if before is not None and not _ENTRY_ID.fullmatch(before):
        raise ValueError(f"before {before[:40]!r}: not an entry id (such as "
                         "1765000000000-0, the id of an entry shown)")
    top = f"({before}" if before else "+"
    found = await redis.xrevrange(audit_log(namespace), max=top, min="-", count=limit)
    return [_record(entry_id, fields) for entry_id, fields in found]
