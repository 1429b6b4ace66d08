"""A rule's keys by capture and state, a page at a time (``coalescer keys``,
``GET /rules/{rule}/keys``, the page's search box, and the bulk actions).

A search names a rule, zero or more ``CAPTURE=VALUE`` filters (every one must hold: the
key's captured segment equals VALUE) and a state (``STATES``; what each holds:
docs/cli.md, "keys").

Each page reads at most ``scan`` entries of the rule's per-shard set (a ZRANGE from where
the page before ended, O(log N + scan): ``store/search_scripts.py``), shard by shard, and
matches their captures here with the rule's own pattern (``config.patterns``): never a
blocking scan. A page may hold no match and still have a ``cursor``: the search goes
on from there. The cursor is opaque text that names the search it belongs to; keys
removed or added meanwhile neither repeat nor hide the keys that stayed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coalescer.config.model import Rule
from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space
from coalescer.store import key_states as states
from coalescer.store import keys as key_names
from coalescer.store.keys import ShardKeys
from coalescer.store.search_scripts import After, set_page

STATES = ("pending", "scheduled", "in-flight", "dead", "paused")
DEFAULT_SCAN = 1000  # set entries a page reads, by default
MAX_SCAN = 10_000
DEFAULT_LIMIT = 100  # matches a page returns at most, by default
MAX_LIMIT = 1000
MAX_CURSOR = 4096  # characters


class SearchError(ValueError):
    """A search that cannot run: ``part`` names what was wrong (``where``, ``state``,
    ``rule``, ``cursor``, ``scan``, ``limit``); the message says what and how."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """Which keys: those of ``rule`` in ``state`` whose captures equal ``where``."""

    rule: str
    state: str = "pending"
    where: tuple[tuple[str, str], ...] = ()

    def signature(self) -> str:
        text = json.dumps([self.rule, self.state, sorted(self.where)])
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    def describe(self) -> str:
        """"the dead keys of rule R where org=42 and user=7"."""
        where = " and ".join(f"{k}={v}" for k, v in self.where)
        return f"the {self.state} keys of rule {self.rule}" + (f" where {where}" if where else "")


def parse_where(rule: Rule, given: Sequence[str] | Mapping[str, str],
                ) -> tuple[tuple[str, str], ...]:
    """``CAPTURE=VALUE`` texts (or a mapping) checked against ``rule``'s captures;
    SearchError naming the part that is wrong."""
    pairs: list[tuple[str, str]] = []
    if isinstance(given, Mapping):
        pairs = [(str(k), str(v)) for k, v in given.items()]
    else:
        for text in given:
            name, eq, value = text.partition("=")
            if not eq or not name:
                raise SearchError("where", f"--where {text!r}: expected CAPTURE=VALUE, "
                                           f"e.g. {_example(rule)}")
            pairs.append((name, value))
    names = rule.pattern.names
    seen: dict[str, str] = {}
    for name, value in pairs:
        if name not in names:
            have = (f"its captures: {', '.join(names)}" if names
                    else "it captures nothing")
            raise SearchError("where", f"--where {name}={value}: rule {rule.name} "
                                       f"(match {rule.pattern.source!r}) has no capture "
                                       f"{name!r} ({have})")
        if seen.get(name, value) != value:
            raise SearchError("where", f"--where {name}= is given twice with different "
                                       f"values ({seen[name]!r}, {value!r}): no key matches both")
        seen[name] = value
    return tuple(sorted(seen.items()))


def _example(rule: Rule) -> str:
    return f"{rule.pattern.names[0]}=42" if rule.pattern.names else "CAPTURE=VALUE"


def make_filter(config: Config, rule: str, *, state: str | None = None,
                where: Sequence[str] | Mapping[str, str] = ()) -> KeyFilter:
    """A checked KeyFilter (SearchError naming what is wrong)."""
    names = [r.name for r in config.rules]
    if rule not in names:
        raise SearchError("rule", f"no rule named {rule!r} (its rules: {', '.join(names)})")
    state = state or "pending"
    if state not in STATES:
        raise SearchError("state", f"--state {state!r}: not a state; one of "
                                   f"{', '.join(STATES)}")
    return KeyFilter(rule=rule, state=state, where=parse_where(config.rule(rule), where))


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a search goes on: the shard, and the last entry read there."""

    shard: int
    after: After | None  # (score, member, its rank when read)

    def encode(self, flt: KeyFilter) -> str:
        body = {"v": 1, "f": flt.signature(), "h": self.shard,
                "a": list(self.after) if self.after else None}
        raw = json.dumps(body, separators=(",", ":")).encode("utf-8", "surrogatepass")
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def moved_back(self, removed: int) -> Cursor:
        """This cursor once ``removed`` entries of its shard's set at or before its entry
        have left the set (a bulk action took them out): its rank that much lower, so
        the next page starts where it is read, with no search for it. A wrong guess
        costs that search, never a key (``set_page`` checks where it reads)."""
        if self.after is None or removed <= 0:
            return self
        score, member, rank = self.after
        return Cursor(self.shard, (score, member, max(-1, rank - removed)))


def decode_cursor(text: str, flt: KeyFilter) -> Cursor:
    """The cursor ``text`` of a page of this search; SearchError("cursor") otherwise."""
    def bad(why: str) -> SearchError:
        return SearchError("cursor", f"--cursor {text[:40]!r}: {why}; pass the cursor a "
                                     "page of this same search gave, or none to start over")
    if len(text) > MAX_CURSOR:
        raise bad(f"longer than {MAX_CURSOR} characters")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        body = json.loads(raw.decode("utf-8", "surrogatepass"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad("not a cursor") from None
    if not isinstance(body, dict) or body.get("v") != 1:
        raise bad("not a cursor")
    if body.get("f") != flt.signature():
        raise bad("a cursor of another search (its rule, state or filters differ)")
    shard, after = body.get("h"), body.get("a")
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
        raise bad("not a cursor")
    if after is not None and not (isinstance(after, list) and len(after) == 3
                                  and all(isinstance(x, str) for x in after[:2])
                                  and _number(after[0]) and isinstance(after[2], int)
                                  and not isinstance(after[2], bool) and after[2] >= 0):
        raise bad("not a cursor")
    return Cursor(shard, (after[0], after[1], after[2]) if after else None)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Found:
    """A key found: its state, shard, captures, and the time its set holds for it
    (pending: due; in flight: lease end; dead: since), epoch ms."""

    key: str
    state: str
    shard: int
    at_ms: int
    captures: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "state": self.state, "shard": self.shard,
                "at_ms": self.at_ms, "captures": self.captures}


@dataclass(slots=True)
class KeysPage:
    """A page: the keys found, how many set entries were read, and the cursor of the
    next page (None: the search is done)."""

    keys: list[Found] = field(default_factory=list)
    examined: int = 0
    cursor: str | None = None
    paused: bool | None = None  # for state "paused": whether the rule is paused
    next: Cursor | None = None  # the cursor, not encoded (a bulk action goes on from it)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"keys": [f.to_json() for f in self.keys],
                                "examined": self.examined, "cursor": self.cursor}
        if self.paused is not None:
            body["paused"] = self.paused
        return body


def _set_of(sk: ShardKeys, flt: KeyFilter) -> str:
    if flt.state == "in-flight":
        return sk.inflight(flt.rule)
    if flt.state == "dead":
        return sk.dead(flt.rule)
    return sk.due(flt.rule)


def _matching(rule: Rule, flt: KeyFilter, key: str) -> dict[str, str] | None:
    captures = rule.pattern.match(key)
    if captures is None:  # kept by an older rules file: it matches no filter
        return None if flt.where else {}
    if any(captures.get(name) != value for name, value in flt.where):
        return None
    return captures


async def _scheduled_only(redis: Any, sk: ShardKeys, found: list[Found]) -> list[Found]:
    if not found:
        return found
    values = await redis.hmget(sk.meta, [f.key for f in found])
    return [f for f, v in zip(found, values, strict=True)
            if v is not None and str(v).startswith("S")
            and (p := states.pending(str(v))) is not None and p.scheduled]


@dataclass(frozen=True, slots=True)
class PageSize:
    """How much one page reads: at most ``scan`` set entries, ``limit`` keys found;
    ``captures`` False leaves a key's captures out when no filter needs them (a bulk
    action on a whole rule: no pattern is matched at all)."""

    scan: int = DEFAULT_SCAN
    limit: int = DEFAULT_LIMIT
    captures: bool = True

    def __post_init__(self) -> None:
        for name, value, most in (("scan", self.scan, MAX_SCAN),
                                  ("limit", self.limit, MAX_LIMIT)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise SearchError(name, f"{name} must be a whole number from 1 to {most}, "
                                        f"got {value!r}")


DEFAULT_PAGE = PageSize()


async def search_page(redis: Any, config: Config, flt: KeyFilter,
                      cursor: str | Cursor | None = None,
                      size: PageSize = DEFAULT_PAGE) -> KeysPage:
    """One page of the search ``flt`` from ``cursor`` (None: the start; a Cursor: a
    page's ``next``), as big as ``size`` says. SearchError for a bad cursor."""
    if isinstance(cursor, Cursor):
        at = cursor
    else:
        at = decode_cursor(cursor, flt) if cursor else Cursor(0, None)
    if flt.state != "paused":
        return await _fill(redis, config, flt, at, size)
    if not await redis.sismember(key_names.paused_rules(config.namespace), flt.rule):
        return KeysPage(paused=False)
    page = await _fill(redis, config, flt, at, size)
    page.paused = True
    return page


async def _fill(redis: Any, config: Config, flt: KeyFilter, at: Cursor,
                size: PageSize) -> KeysPage:
    page = KeysPage()
    space = await current_space(redis, config)
    rule = config.rule(flt.rule)
    shard, after = at.shard, at.after
    scan, limit = size.scan, size.limit
    while shard < space.span and page.examined < scan and len(page.keys) < limit:
        sk = space.shard(shard)
        want = scan - page.examined
        entries, first = await set_page(redis, _set_of(sk, flt), after, want)
        found, read = _page_matches(rule if size.captures or flt.where else None, flt,
                                    shard, entries, limit - len(page.keys))
        page.examined += read
        if read:
            after = (entries[read - 1][1], entries[read - 1][0], first + read - 1)
        if flt.state == "scheduled":
            found = await _scheduled_only(redis, sk, found)
        page.keys += found
        if read == len(entries) < want:  # the end of this shard's set
            shard, after = shard + 1, None
    if shard < space.span:
        page.next = Cursor(shard, after)
        page.cursor = page.next.encode(flt)
    return page


def _page_matches(rule: Rule | None, flt: KeyFilter, shard: int,
                  entries: list[tuple[str, str]], room: int) -> tuple[list[Found], int]:
    """The keys of ``entries`` that match (at most ``room``), and how many entries were
    read to find them (``rule`` None: every key, its captures left out)."""
    found: list[Found] = []
    for read, (member, score) in enumerate(entries, start=1):
        captures = _matching(rule, flt, member) if rule is not None else {}
        if captures is not None:
            found.append(Found(member, flt.state, shard, int(float(score)), captures))
            if len(found) >= room:
                return found, read
    return found, len(entries)
