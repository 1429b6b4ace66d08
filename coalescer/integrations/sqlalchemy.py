"""Touch keys once a SQLAlchemy ``Session``'s transaction commits, or in it.

``touch_in_transaction``, ``outbox_table`` and ``outbox_ddl`` (from
``coalescer.integrations.outbox_sqlalchemy``) write touches as rows of an outbox table
in the transaction itself, read by a node's ``type: outbox`` source.
``touch_after_commit(session, coalescer, *keys)`` (below) records the keys on the
session's current transaction (the innermost savepoint, if one is open) and touches them
once the outermost one commits. How it treats savepoints, rollbacks, a session with no
transaction, ``AsyncSession`` and a ``touch`` that raises at commit: docs/durability.md,
"Touch after commit", "SQLAlchemy".
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from coalescer.integrations import Toucher, checked_keys
from coalescer.integrations.outbox_sqlalchemy import (
    innermost,
    outbox_ddl,
    outbox_table,
    touch_in_transaction,
)

__all__ = ["outbox_ddl", "outbox_table", "touch_after_commit", "touch_in_transaction"]

log = logging.getLogger(__name__)

_STATE = "coalescer.touch_after_commit"

Pending = list[tuple[Toucher, str]]


class _Touches:
    """The keys recorded on one session, per open transaction, and how each ended."""

    def __init__(self) -> None:
        self.by_transaction: dict[SessionTransaction, Pending] = defaultdict(list)
        self.committed: set[SessionTransaction] = set()
        self.rolled_back: set[SessionTransaction] = set()


def touch_after_commit(session: Any, coalescer: Toucher, *keys: str) -> None:
    """Touch ``keys`` with ``coalescer`` once ``session``'s transaction commits.

    Raises UnknownKeyError or InvalidKeyError at once for a key that could never be
    touched, so nothing fails inside the commit.
    """
    session = getattr(session, "sync_session", session)  # an AsyncSession
    checked = checked_keys(coalescer, keys)
    current = innermost(session)
    if current is None:
        for key in checked:
            coalescer.touch(key)
        return
    _touches(session).by_transaction[current].extend((coalescer, k) for k in checked)


def _touches(session: Session) -> _Touches:
    state = session.info.get(_STATE)
    if state is None:
        state = session.info[_STATE] = _Touches()
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_rollback", _after_rollback)
        event.listen(session, "after_transaction_end", _after_transaction_end)
    assert isinstance(state, _Touches)
    return state


def _after_commit(session: Session) -> None:
    # Fired just before the ending transaction's after_transaction_end, while it is
    # still the session's innermost one (a released savepoint or the outermost).
    current = innermost(session)
    if current is not None:
        _touches(session).committed.add(current)


def _after_rollback(session: Session) -> None:
    current = innermost(session)
    if current is not None:
        _touches(session).rolled_back.add(current)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    state = _touches(session)
    pending = state.by_transaction.pop(transaction, [])
    committed = transaction in state.committed
    rolled_back = transaction in state.rolled_back
    state.committed.discard(transaction)
    state.rolled_back.discard(transaction)
    if not pending:
        return
    if transaction.parent is not None:
        if not rolled_back:  # a released savepoint: its keys wait for the enclosing one
            state.by_transaction[transaction.parent].extend(pending)
        return
    if committed:
        _touch_all(pending)
    else:
        log.debug("transaction ended uncommitted: %d touches dropped", len(pending))


def _touch_all(pending: Pending) -> None:
    by_coalescer: dict[int, tuple[Toucher, list[str]]] = {}
    for coalescer, key in pending:
        by_coalescer.setdefault(id(coalescer), (coalescer, []))[1].append(key)
    first: Exception | None = None
    for coalescer, keys in by_coalescer.values():
        try:
            for key in dict.fromkeys(keys):
                coalescer.touch(key)
        except Exception as exc:  # every other coalescer's keys are still touched
            log.error("after commit: could not touch %d keys (%s...): %r", len(keys),
                      keys[0], exc)
            first = first or exc
    if first is not None:
        raise first
