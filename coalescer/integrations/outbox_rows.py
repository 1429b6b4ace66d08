"""What the outbox writers share: the rows of a call, checked as ``touch()`` checks keys.

A key Redis cannot store is refused at the call (InvalidKeyError), never later in a
commit hook or on the node, and so is an item that cannot be stored (InvalidItemError).
With ``rules`` (a ``Config``, ``Coalescer`` or ``SyncCoalescer``) a key no rule matches
is refused too (UnknownKeyError), and an item for a rule without ``items:``
(InvalidItemError); without, the node that reads the outbox rejects such a row (logged
and counted, the other rows go on).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coalescer.errors import InvalidItemError
from coalescer.sources.outbox_sql import DEFAULT_OUTBOX_TABLE, postgres_ddl
from coalescer.store.keycheck import check_item, check_key, item_problem

__all__ = ["DEFAULT_TABLE", "ROWS_PER_INSERT", "checked_rows", "postgres_ddl"]

DEFAULT_TABLE = DEFAULT_OUTBOX_TABLE
ROWS_PER_INSERT = 1000  # rows of one INSERT statement (2,000 parameters: every driver's fine)


def rules_of(rules: Any) -> Any:
    """The ``Config`` of ``rules``: a Config, a Coalescer or a SyncCoalescer (or None)."""
    for found in (rules, getattr(rules, "config", None),
                  getattr(getattr(rules, "coalescer", None), "config", None)):
        if found is not None and hasattr(found, "rule_for"):
            return found
    return None


def checked_rows(keys: Iterable[str], item: str | None,
                 rules: Any) -> list[tuple[str, str | None]]:
    """``(key, item)`` for each key, once each is known to be storable (and matched by a
    rule of ``rules`` that takes items, when given)."""
    config = rules_of(rules)
    out = []
    for key in keys:
        check_key(key)
        if item is not None:
            problem = item_problem(item)
            if problem is not None:
                raise InvalidItemError(key, item, problem)
        if config is not None:
            rule = config.rule_for(key)
            if item is not None:
                check_item(key, item, rule.name, rule.items is not None)
        out.append((key, item))
    return out
