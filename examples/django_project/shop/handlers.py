"""The refresh handler: it imports models at its top, so its module imports only where
Django is set up (``python manage.py coalescer run`` does that first)."""

from __future__ import annotations

from django.db import close_old_connections
from django.db.models import Count, Sum

from coalescer import Claim

from .models import CustomerStats, Order


def refresh_customer_stats(claim: Claim) -> None:
    """Recompute one customer's stats from their orders (``stats:customer:{id}``).

    A plain function: it runs in a thread of the node, which keeps a database
    connection of its own; stale ones are closed before and after, as Django does
    around a request.
    """
    close_old_connections()
    try:
        customer_id = int(claim.params["id"])
        totals = Order.objects.filter(customer_id=customer_id).aggregate(
            orders=Count("id"), total_cents=Sum("total_cents"))
        CustomerStats.objects.update_or_create(
            customer_id=customer_id,
            defaults={"orders": totals["orders"], "total_cents": totals["total_cents"] or 0})
    finally:
        close_old_connections()
