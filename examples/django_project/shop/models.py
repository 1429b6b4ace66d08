"""Orders, and the per-customer aggregate that the handler recomputes."""

from __future__ import annotations

from typing import Any

from django.db import models


class Order(models.Model):
    customer_id: models.IntegerField[Any, int] = models.IntegerField(db_index=True)
    total_cents: models.IntegerField[Any, int] = models.IntegerField()


class CustomerStats(models.Model):
    """Written only by the handler: one row per customer, recomputed from the orders."""

    customer_id: models.IntegerField[Any, int] = models.IntegerField(primary_key=True)
    orders: models.IntegerField[Any, int] = models.IntegerField()
    total_cents: models.IntegerField[Any, int] = models.IntegerField()
    refreshed_at: models.DateTimeField[Any, Any] = models.DateTimeField(auto_now=True)
