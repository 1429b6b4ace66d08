"""``coalescer touch --priority DURATION``: the check of the flag before anything is
touched (config/priority.py says what a priority is)."""

from __future__ import annotations

import sys

from coalescer.config.priority import priority_ms
from coalescer.config.rules import Config
from coalescer.errors import InvalidPriorityError


def refuse_priority(keys: list[str], priority: str | None, config: Config) -> bool:
    """Print why ``--priority`` cannot be used for one of ``keys`` (each matching a rule);
    True if it cannot."""
    if priority is None:
        return False
    try:
        for key in keys:
            priority_ms(key, priority, config.rule_for(key))
    except InvalidPriorityError as exc:
        print(f"coalescer touch: --priority {priority!r} for key {exc.key!r}: {exc.reason}",
              file=sys.stderr)
        print("coalescer touch: nothing was touched", file=sys.stderr)
        return True
    return False
