"""Touch keys once a Django database transaction commits.

``touch_on_commit(*keys, coalescer=c, using=None)`` hands the touch to Django's
``transaction.on_commit`` for the database ``using`` (the default one if None). So
it behaves as every on-commit callback does: inside ``transaction.atomic()`` the
keys are touched once the outermost block commits, and never if it rolls back; a
rolled-back inner block (a savepoint) drops the keys it recorded; outside any
atomic block (autocommit) they are touched at once. ``coalescer`` is typically a
``SyncCoalescer`` started once per process.
"""

from __future__ import annotations

from functools import partial

from django.db import transaction

from coalescer.integrations import Toucher, checked_keys


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
