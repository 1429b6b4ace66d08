"""Touch keys in a Django database transaction (the outbox), or once it commits.

``touch_in_transaction(*keys, using=None)`` writes the touches as rows of the outbox
model (``models.OutboxTouch``, table ``coalescer_outbox``) in the current transaction,
one multi-row ``INSERT`` per call; Django has no hook just before a commit, so
``outbox_touches(using=None)`` collects a block's touches into one ``INSERT`` when it
ends. ``touch_on_commit(*keys, coalescer=c, using=None)`` hands the touch to
``transaction.on_commit``; ``c`` is typically ``get_coalescer()``, the process's own
``SyncCoalescer`` (``process``, with ``drain()`` for tests and ``close_coalescer()``).
``python manage.py coalescer ...`` is the ``coalescer`` command with Django set up
first. How each behaves with savepoints, autocommit and migrations: docs/django.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from django.db import DEFAULT_DB_ALIAS, transaction

from coalescer.integrations import Toucher, checked_keys
from coalescer.integrations.django.process import close_coalescer, drain, get_coalescer
from coalescer.integrations.outbox_rows import ROWS_PER_INSERT, checked_rows

__all__ = ["close_coalescer", "drain", "get_coalescer", "outbox_touches",
           "touch_in_transaction", "touch_on_commit"]


def touch_in_transaction(*keys: str, using: str | None = None, item: str | None = None,
                         rules: Any = None) -> None:
    """Write touches of ``keys`` (with ``item``, if given) as outbox rows in the current
    transaction of the database ``using`` (the default one if None).

    Every key is checked first, as ``touch()`` checks it (InvalidKeyError; with
    ``rules``, a ``Config``, ``Coalescer`` or ``SyncCoalescer``, UnknownKeyError for a
    key no rule matches): a refused call writes nothing.
    """
    _insert(list(dict.fromkeys(checked_rows(keys, item, rules))), using)


@contextmanager
def outbox_touches(using: str | None = None,
                   rules: Any = None) -> Iterator[Callable[..., None]]:
    """Collect touches in a block and write them as outbox rows of the database
    ``using`` in one multi-row ``INSERT`` when the block ends (nothing if it raises).
    Use it inside ``transaction.atomic()``, so that the rows commit with the data::

        with transaction.atomic(), outbox_touches() as touch:
            order.save()
            touch(f"stats:customer:{order.customer_id}", item=str(order.id))

    ``touch(*keys, item=None)`` checks its keys at once, as ``touch_in_transaction``
    does (a refused call adds nothing)."""
    rows: list[tuple[str, str | None]] = []

    def touch(*keys: str, item: str | None = None) -> None:
        rows.extend(checked_rows(keys, item, rules))

    yield touch
    _insert(list(dict.fromkeys(rows)), using)


def _insert(rows: list[tuple[str, str | None]], using: str | None) -> None:
    from coalescer.integrations.django.models import OutboxTouch

    if rows:
        OutboxTouch.objects.using(using or DEFAULT_DB_ALIAS).bulk_create(
            [OutboxTouch(key=key, item=row_item) for key, row_item in rows],
            batch_size=ROWS_PER_INSERT)


def touch_on_commit(*keys: str, coalescer: Toucher, using: str | None = None) -> None:
    """Touch ``keys`` with ``coalescer`` once the current transaction of ``using`` commits.

    Raises UnknownKeyError or InvalidKeyError at once for a key that could never be
    touched, so nothing fails inside the commit.
    """
    checked = checked_keys(coalescer, keys)
    if checked:
        transaction.on_commit(partial(_touch, coalescer, checked), using=using)


def _touch(coalescer: Toucher, keys: list[str]) -> None:
    for key in keys:
        coalescer.touch(key)
