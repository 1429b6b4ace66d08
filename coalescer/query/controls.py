"""An operator's controls: pause and resume a rule, run keys now (what each does:
docs/operations.md, "Operator controls").

Pausing is cluster-wide and survives restarts: the rule's name goes into the
namespace's paused set (``store.keys.paused_rules``) and into every shard's copy of it
(``store.paused_copies``), which the claim scripts read as they claim, and the change
is announced on ``paused_channel``, where every worker node hears it and reads the set
again (``worker.paused``). Once a pause returns, no node claims the rule's keys, even
one that has not heard of it yet (cut off from the announcement, say).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space, home_of
from coalescer.store import keys as key_names
from coalescer.store.keycheck import check_key
from coalescer.store.paused_copies import mark_paused
from coalescer.store.scripts import Scripts

log = logging.getLogger(__name__)

RUNS_NEXT = ("hastened", "due")  # what run_now.lua answers for a key it will run


def known_rule(config: Config, rule: str) -> str:
    """``rule`` if the rules name it; else KeyError naming the rules there are."""
    names = [r.name for r in config.rules]
    if rule not in names:
        raise KeyError(f"no rule named {rule!r} (its rules: {', '.join(names)})")
    return rule


async def paused_rules(redis: Any, config: Config) -> list[str]:
    """The names of the rules paused now, sorted."""
    return sorted(str(n) for n in await redis.smembers(key_names.paused_rules(
        config.namespace)))


async def set_paused(redis: Any, config: Config, rule: str, *, paused: bool) -> bool:
    """Pause (or resume) ``rule`` across the namespace and tell the worker nodes;
    whether that changed anything (False: it already was). KeyError for no such rule
    (a paused rule these rules lack can still be resumed: another node's rules file,
    during a rolling deploy, may have it)."""
    ns = config.namespace
    if paused:
        known_rule(config, rule)
        changed = await redis.sadd(key_names.paused_rules(ns), rule)
    else:
        changed = await redis.srem(key_names.paused_rules(ns), rule)
        if not changed:
            known_rule(config, rule)
    space = await current_space(redis, config)
    await mark_paused(redis, space.all_shards(), rule, paused=paused)
    await redis.publish(key_names.paused_channel(ns), rule)
    if changed:
        log.info("rule %s %s", rule, "paused" if paused else "resumed")
    return bool(changed)


@dataclass(frozen=True, slots=True)
class RunNowOutcome:
    """What a run-now did: the keys that run next, and the named keys that were not
    pending, with the state each key was found in.

    States: ``hastened`` (made due now), ``due`` (it already was); and, not pending:
    ``running`` (its refresh runs now), ``dead`` (dead-lettered: re-queue it with
    ``retry_dead``), ``idle`` (nothing pending: touch it first).
    """

    run: list[str] = field(default_factory=list)
    not_pending: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "not_pending": self.not_pending, "states": self.states}


async def run_now(redis: Any, scripts: Scripts, config: Config,
                  keys: list[str]) -> RunNowOutcome:
    """Make each pending key of ``keys`` due now. Every key is checked first:
    UnknownKeyError or InvalidKeyError runs nothing."""
    keys = list(dict.fromkeys(keys))
    rules = {}
    for key in keys:
        check_key(key)
        rules[key] = config.rule_for(key).name
    space = await current_space(redis, config)
    outcome = RunNowOutcome()
    for key in keys:
        shard = space.shard(await home_of(redis, space, key))
        state = await scripts.run_now(shard, rules[key], key)
        outcome.states[key] = state
        (outcome.run if state in RUNS_NEXT else outcome.not_pending).append(key)
    return outcome
