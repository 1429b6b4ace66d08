"""Reading and changing a fair rule's weights and cap at runtime (``coalescer fair``,
``GET``/``POST /rules/{rule}/fair``).

A change is written to the namespace's settings and to every shard's copy
(``store/fair_settings.py``) before it returns: every node's next claim follows it, no
restart. Settings made at runtime override the rules file's, value by value; a reset
drops them all (the file's hold again)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coalescer.config.fair import MAX_RUNNING, check_weight
from coalescer.config.rules import Config
from coalescer.query.layout_read import current_space
from coalescer.store.fair_settings import (
    NO_CAP,
    FairChange,
    read_overrides,
    record_in_flight,
    write_overrides,
)


class NotFairError(ValueError):
    """The rule exists but has no ``fair:`` (or the change is not valid)."""


@dataclass(frozen=True, slots=True)
class FairView:
    """A fair rule's settings in force: ``weights`` (every value named, by the file or
    at runtime; others weigh 1) and ``max_running`` (None: no cap), with where each came
    from (``runtime_weights``, ``runtime_cap``: set at runtime)."""

    rule: str
    by: str
    weights: dict[str, float] = field(default_factory=dict)
    max_running: int | None = None
    runtime_weights: dict[str, float] = field(default_factory=dict)
    runtime_cap: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "by": self.by, "weights": self.weights,
                "max_running": self.max_running, "runtime_weights": self.runtime_weights,
                "runtime_max_running": self.runtime_cap}


def fair_rule(config: Config, rule: str) -> tuple[str, Mapping[str, float], int | None]:
    """The rule's capture, file weights and file cap; KeyError for no such rule,
    NotFairError when it has no ``fair:``."""
    names = [r.name for r in config.rules]
    if rule not in names:
        raise KeyError(f"no rule named {rule!r} (its rules: {', '.join(names)})")
    fair = config.rule(rule).fair
    if fair is None:
        raise NotFairError(f"rule {rule!r} has no fair: in its rules; give it fair: {{by: "
                           f"\"{{capture}}\"}} first (weights and caps order its groups)")
    return fair.by, fair.weights, fair.max_running


async def fair_view(redis: Any, config: Config, rule: str) -> FairView:
    """The settings in force for ``rule`` (KeyError, NotFairError as ``fair_rule``)."""
    by, weights, cap = fair_rule(config, rule)
    over = await read_overrides(redis, config.namespace, rule)
    if over.cap is not None:
        cap = None if over.cap == NO_CAP else over.cap
    return FairView(rule=rule, by=by, weights=dict(weights) | over.weights, max_running=cap,
                    runtime_weights=over.weights, runtime_cap=over.cap is not None)


def _refusal(prefix: str) -> Callable[[str], Exception]:
    def refuse(message: str) -> Exception:
        return NotFairError(prefix + message)
    return refuse


def checked_change(weights: Mapping[str, object], max_running: object,
                   reset: bool = False) -> FairChange:
    """A change with every value checked (NotFairError naming the bad one): weights
    above 0, max_running a whole number from 1 (or None: unchanged; 0: no cap)."""
    checked = {}
    for value, weight in weights.items():
        if not value or ":" in value:
            raise NotFairError(f"weight for {value!r}: a value of the capture is a "
                               "non-empty segment without ':'")
        checked[value] = check_weight(weight, _refusal(f"weight for {value!r}: "))
    if max_running is not None and (isinstance(max_running, bool)
                                    or not isinstance(max_running, int)
                                    or not 0 <= max_running <= MAX_RUNNING):
        raise NotFairError(f"max_running must be a whole number from 1 to {MAX_RUNNING} "
                           f"(0: no cap), got {max_running!r}")
    return FairChange(weights=checked, cap=max_running, reset=reset)


async def set_fair(redis: Any, config: Config, rule: str, change: FairChange) -> FairView:
    """Apply ``change`` to ``rule`` across the namespace; the settings now in force."""
    by = fair_rule(config, rule)[0]
    space = await current_space(redis, config)
    await write_overrides(redis, config.namespace, space.all_shards(), rule, change)
    if change.cap:  # the runs already going count against the cap from now on
        pattern = config.rule(rule).pattern

        def group_of(key: str) -> str | None:
            found = pattern.match(key)
            return None if found is None else found[by]
        await record_in_flight(redis, config.namespace, space.all_shards(), rule, group_of)
    return await fair_view(redis, config, rule)
