"""Dead letters: listing them with totals and paging, re-queueing, purging.

A key is dead-lettered once its last retry failed; it stays in its rule's
``dead`` set (with when it died) and its meta field holds its error. A retry
re-queues it, due now, with fresh attempts; a purge deletes it for good. Both
act only on keys that are still dead, and report the others by name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coalescer.common.plural import plural
from coalescer.common.printable import printable_values
from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space, home_of
from coalescer.store.keys import ShardKeys

BATCH = 500
DEFAULT_PAGE = 20

# One script call on dead keys of one rule of one shard: (done, not dead keys).
Action = Callable[[ShardKeys, str, Sequence[str]], Awaitable[tuple[int, list[str]]]]


@dataclass(frozen=True, slots=True)
class DeadOutcome:
    """What a retry or purge did: how many keys, and the named keys that were not dead."""

    done: int
    not_dead: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DeadPage:
    """One page of dead letters, oldest first, and how many there are in all."""

    total: int
    offset: int
    limit: int
    entries: list[dict[str, Any]]
    not_dead: list[str] = field(default_factory=list)  # named keys that are not dead

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "offset": self.offset, "limit": self.limit,
                "dead_letters": self.entries, "not_dead": self.not_dead}


def dead_entry(key: str, rule: str, since: float, meta: str | None) -> dict[str, Any]:
    """A dead letter as JSON, from its dead-set score and its meta field."""
    parts = (meta or "").split("|", 4)
    dead = len(parts) > 4 and parts[0] == "D"
    return {"key": key, "rule": rule, "since_ms": int(since),
            "attempts": int(parts[3]) if dead and parts[3].isdigit() else None,
            "error": parts[4] if dead else ""}


def _selected(config: Config, rule: str | None) -> list[str]:
    if rule is None:
        return [r.name for r in config.rules]
    config.rule(rule)  # KeyError names an unknown rule
    return [rule]


async def list_dead(redis: Any, config: Config, *, rule: str | None = None,
                    limit: int = DEFAULT_PAGE, offset: int = 0) -> DeadPage:
    """A page of dead letters (of one rule, or all), oldest first, with the total."""
    if limit < 1 or offset < 0:
        raise ValueError(f"limit must be 1 or more and offset 0 or more, got {limit}, {offset}")
    space = await current_space(redis, config)
    sets = [(sk, name) for sk in space.all_shards() for name in _selected(config, rule)]
    pipe = redis.pipeline(transaction=False)
    for sk, name in sets:
        pipe.zcard(sk.dead(name))
        pipe.zrange(sk.dead(name), 0, offset + limit - 1, withscores=True)
    answers = await pipe.execute()
    total = sum(int(n) for n in answers[0::2])
    found = [(since, key, name, sk) for (sk, name), head in zip(sets, answers[1::2], strict=True)
             for key, since in head]
    found.sort(key=lambda f: (f[0], f[1]))
    page = found[offset:offset + limit]
    pipe = redis.pipeline(transaction=False)
    for _, key, _, sk in page:
        pipe.hget(sk.meta, key)
    metas = await pipe.execute() if page else []
    entries = [dead_entry(key, name, since, meta)
               for (since, key, name, _), meta in zip(page, metas, strict=True)]
    return DeadPage(total, offset, limit, entries)


async def look_up_dead(redis: Any, config: Config, keys: Sequence[str]) -> DeadPage:
    """The named keys' dead letters; the keys that are not dead are listed apart."""
    space = await current_space(redis, config)
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        sk = space.shard(await home_of(redis, space, key))
        pipe.zscore(sk.dead(config.rule_for(key).name), key)
        pipe.hget(sk.meta, key)
    answers = await pipe.execute()
    entries, not_dead = [], []
    for key, since, meta in zip(keys, answers[0::2], answers[1::2], strict=True):
        if since is None or not str(meta or "").startswith("D|"):
            not_dead.append(key)
        else:
            entries.append(dead_entry(key, config.rule_for(key).name, since, meta))
    return DeadPage(len(entries), 0, len(keys), entries, not_dead)


async def act_on_keys(redis: Any, config: Config, action: Action,
                      keys: Iterable[str]) -> DeadOutcome:
    """Run ``action`` on the named keys, grouped by shard and rule."""
    space = await current_space(redis, config)
    groups: dict[tuple[int, str], list[str]] = defaultdict(list)
    for key in keys:
        groups[(await home_of(redis, space, key), config.rule_for(key).name)].append(key)
    done, not_dead = 0, []
    for (shard, rule), group in groups.items():
        for i in range(0, len(group), BATCH):
            n, missing = await action(space.shard(shard), rule, group[i:i + BATCH])
            done += n
            not_dead += missing
    return DeadOutcome(done, not_dead)


async def act_on_all(redis: Any, config: Config, action: Action,
                     rule: str | None = None) -> DeadOutcome:
    """Run ``action`` on every dead key (of ``rule``, or of every rule)."""
    space = await current_space(redis, config)
    done = 0
    for sk in space.all_shards():
        for name in _selected(config, rule):
            while batch := await redis.zrange(sk.dead(name), 0, BATCH - 1):
                n, _ = await action(sk, name, batch)
                done += n
                if n == 0:
                    break
    return DeadOutcome(done)


def format_dead_page(page: DeadPage) -> str:
    """A page of dead letters as a table, with the totals and how to page on."""
    if page.total == 0 and not page.not_dead:
        return "no dead letters"
    first = page.offset + 1 if page.entries else page.offset
    lines = [f"showing {len(page.entries)} of {plural(page.total, 'dead letter')}"
             + (f" ({first}-{page.offset + len(page.entries)}, oldest first)"
                if page.entries else "")]
    for d in printable_values(page.entries):
        after = plural(d["attempts"], "attempt") if d["attempts"] is not None else "? attempts"
        lines.append(f"  {d['key']}  [{d['rule']}] after {after}: {d['error']}")
    shown = page.offset + len(page.entries)
    if shown < page.total and page.entries:
        lines.append(f"next page: --offset {shown} --limit {page.limit}")
    return "\n".join(lines)
