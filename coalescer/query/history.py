"""Reading the refresh history: one capped Redis stream per shard.

Every finished refresh (its key, rule, node, fencing token, attempt, due time and
start on the server clock, duration, outcome and error) is appended to its shard's
stream by the same Lua call that records its result (``ack.lua``, ``fail.lua``),
so the history costs no extra round trip. ``history`` in rules.yaml caps each
stream (approximately: Redis trims whole blocks); 0 records nothing.

Reads are pipelined: one round trip for every shard (one per node on a cluster).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from coalescer.common.printable import printable
from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space, history_shards
from coalescer.store.keys import KeySpace, ShardKeys

FAILED_OUTCOMES = ("failure", "timeout", "lost")
CANCELLED = "cancelled"  # a cancel's entry (cancel.lua): no refresh ran
RECENT = 200  # refreshes per shard that `status` counts failures over


@dataclass(frozen=True, slots=True)
class Refresh:
    """One finished refresh as the history recorded it (times: server clock, ms)."""

    id: str
    key: str
    rule: str
    node: str
    token: int
    attempt: int | None
    start_ms: int
    duration_ms: int
    outcome: str  # success, failure, timeout, lost (its claim had been taken over), or
    # cancelled (no refresh: a cancel dropped the key's pending refresh, due at due_ms)
    error: str
    due_ms: int | None = None  # the due time it was claimed at (not recorded for lost ones)
    batch: int = 0  # keys in the batch handler call it ran in (0: a refresh of its own)

    @property
    def failed(self) -> bool:
        return self.outcome in FAILED_OUTCOMES

    @property
    def order(self) -> tuple[int, int]:
        """Sort key: when the result was recorded (the stream entry id)."""
        ms, _, seq = self.id.partition("-")
        return int(ms), int(seq or 0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _optional_int(value: str | None) -> int | None:
    return int(value) if value and value.lstrip("-").isdigit() else None


def parse_entry(entry_id: str, fields: dict[str, str]) -> Refresh:
    """A stream entry as a Refresh (missing or odd fields read as empty)."""
    attempt = fields.get("attempt")
    return Refresh(id=entry_id, key=fields.get("key", ""), rule=fields.get("rule", ""),
                   node=fields.get("node", ""), token=_int(fields.get("token")),
                   attempt=int(attempt) if attempt and attempt.isdigit() else None,
                   start_ms=_int(fields.get("start")), duration_ms=_int(fields.get("ms")),
                   outcome=fields.get("outcome", ""), error=fields.get("error", ""),
                   due_ms=_optional_int(fields.get("due")))


def parse_entries(entry_id: str, fields: dict[str, str]) -> list[Refresh]:
    """A stream entry as its refreshes: one, or each key of a batch entry (which records
    the successes of one batch handler call)."""
    if "keys" not in fields:
        return [parse_entry(entry_id, fields)]
    keys = fields["keys"].split("\0")
    columns = [fields.get(name, "").split(",") for name in ("tokens", "attempts", "dues")]
    size = _int(fields.get("batch"), len(keys))
    out = []
    for i, key in enumerate(keys):
        token, attempt, due = (column[i] if i < len(column) else "" for column in columns)
        one = fields | {"key": key, "token": token, "attempt": attempt, "due": due}
        out.append(replace(parse_entry(entry_id, one), batch=size))
    return out


async def read_streams(redis: Any, shards: Sequence[ShardKeys],
                       count: int | None) -> list[Refresh]:
    """The newest ``count`` entries (all when None) of each shard's stream, pipelined."""
    pipe = redis.pipeline(transaction=False)
    for sk in shards:
        pipe.xrevrange(sk.history, "+", "-", count=count)
    out: list[Refresh] = []
    for entries in await pipe.execute():
        for entry_id, fields in entries:
            out += parse_entries(entry_id, fields)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class HistoryQuery:
    """Which refreshes to show: filters, and how many at most (newest first)."""

    rule: str | None = None
    key: str | None = None
    failed: bool = False
    limit: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"the number of refreshes to show must be 1 or more, "
                             f"got {self.limit!r}")

    @property
    def filtered(self) -> bool:
        return self.rule is not None or self.key is not None or self.failed

    def wants(self, r: Refresh) -> bool:
        return ((self.rule is None or r.rule == self.rule)
                and (self.key is None or r.key == self.key)
                and (not self.failed or r.failed))


async def read_history(redis: Any, config: Config, query: HistoryQuery) -> list[Refresh]:
    """The refreshes ``query`` asks for, newest first, merged across the shards.

    Unfiltered, each shard's newest ``limit`` entries are read; filtered, each
    whole (capped) stream is.
    """
    shards = [ShardKeys(config.namespace, n)
              for n in await history_shards(redis, config, query.key)]
    found = await read_streams(redis, shards, None if query.filtered else query.limit)
    picked = [r for r in found if query.wants(r)]
    picked.sort(key=lambda r: r.order, reverse=True)
    return picked[:query.limit]


async def recent_by_rule(redis: Any, config: Config, per_shard: int = RECENT,
                         space: KeySpace | None = None) -> dict[str, dict[str, int]]:
    """Per rule, how many of the shards' newest refreshes ran and how many failed
    (in ``space``'s shards: by default, the namespace's now)."""
    out = {rule.name: {"refreshes": 0, "failed": 0} for rule in config.rules}
    space = space or await current_space(redis, config)
    for r in await read_streams(redis, space.all_shards(), per_shard):
        counts = out.get(r.rule)
        if counts is not None and r.outcome != CANCELLED:
            counts["refreshes"] += 1
            counts["failed"] += int(r.failed)
    return out


# -- formatting ---------------------------------------------------------------------------


def clock(ms: int) -> str:
    """Server-clock epoch ms as local date and time, to the millisecond."""
    moment = datetime.datetime.fromtimestamp(ms / 1000)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}"


def format_duration_ms(ms: int) -> str:
    return f"{ms} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


# The table's columns: header, minimum width, right-aligned; KEY, last, is not padded.
_COLUMNS = (("STARTED", 23, False), ("DURATION", 9, True), ("OUTCOME", 9, False),
            ("RULE", 16, False), ("TRY", 3, True), ("TOKEN", 8, True), ("NODE", 20, False),
            ("KEY", 0, False))
_GAPS = ("  ", "  ", " ", " ", " ", "  ", " ")  # between one column and the next


def _cells(r: Refresh) -> list[str]:
    attempt = str(r.attempt) if r.attempt is not None else "-"
    cancelled = r.outcome == CANCELLED  # no refresh ran: no duration, no token
    took = "-" if cancelled else format_duration_ms(r.duration_ms)
    token = "-" if cancelled else str(r.token)
    return [clock(r.start_ms), took, r.outcome, r.rule, attempt, token, r.node, r.key]


def _line(cells: list[str], widths: list[int]) -> str:
    """One row: each cell padded to its column's width, the last one as it is."""
    padded = [cell.rjust(width) if right else cell.ljust(width)
              for cell, width, (_, _, right) in zip(cells[:-1], widths, _COLUMNS, strict=False)]
    line = "".join(cell + gap for cell, gap in zip(padded, _GAPS, strict=True))
    return line + cells[-1]


def _shown(r: Refresh) -> Refresh:
    """``r`` with its texts escaped for a terminal (control characters as ``\\x1b``)."""
    return replace(r, key=printable(r.key), rule=printable(r.rule), node=printable(r.node),
                   error=printable(r.error))


def format_history(refreshes: Iterable[Refresh]) -> str:
    """A readable table, newest first; each error on its own line below its refresh.
    Each column is as wide as its widest cell (a long token, rule or node name shifts
    the columns after it, never out of line)."""
    shown = [_shown(r) for r in refreshes]
    if not shown:
        return "no refreshes recorded (yet) that match"
    cells = [_cells(r) for r in shown]
    widths = [max(minimum, len(head), *(len(row[i]) for row in cells))
              for i, (head, minimum, _) in enumerate(_COLUMNS[:-1])]
    lines = [_line([head for head, _, _ in _COLUMNS], widths)]
    for r, row in zip(shown, cells, strict=True):
        line = _line(row, widths) + (f"  (batch of {r.batch})" if r.batch else "")
        lines.append(f"{line}\n{'':<25}error: {r.error}" if r.error else line)
    return "\n".join(lines)
