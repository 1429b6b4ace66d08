"""The outbox model: one row per touch written in a transaction, deleted by the node
that touched its key in Redis."""

from __future__ import annotations

from typing import Any

from django.db import models

from coalescer.sources.outbox_sql import DEFAULT_OUTBOX_TABLE


class OutboxTouch(models.Model):
    """A touch of ``key`` (with ``item``) waiting in the outbox for a node."""

    id: models.BigAutoField[Any, int] = models.BigAutoField(primary_key=True)
    key: models.TextField[str, str] = models.TextField()
    item: models.TextField[str | None, str | None] = models.TextField(null=True)
    created_at: models.DateTimeField[Any, Any] = models.DateTimeField(auto_now_add=True)

    class Meta:
        app_label = "coalescer"
        db_table = DEFAULT_OUTBOX_TABLE

    def __str__(self) -> str:
        return f"touch {self.key!r}" + (f" ({self.item!r})" if self.item is not None else "")
