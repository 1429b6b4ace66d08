"""Views: an order touches its customer's stats key once the transaction commits."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from coalescer.integrations.django import get_coalescer, touch_on_commit

from .models import CustomerStats, Order


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> HttpResponse:
    try:
        customer_id = int(request.POST["customer"])
        total_cents = int(request.POST["total_cents"])
    except (KeyError, ValueError):
        return JsonResponse({"error": "customer and total_cents must be integers"}, status=400)
    with transaction.atomic():
        order = Order.objects.create(customer_id=customer_id, total_cents=total_cents)
        # touched once the order is committed; never if the block rolls back
        touch_on_commit(f"stats:customer:{customer_id}", coalescer=get_coalescer())
    return JsonResponse({"order": order.pk}, status=201)


@require_GET
def customer_stats(request: HttpRequest, customer_id: int) -> HttpResponse:
    """The stats as last refreshed (404 until the first refresh)."""
    stats = CustomerStats.objects.filter(customer_id=customer_id).first()
    if stats is None:
        return JsonResponse({"error": "not refreshed yet"}, status=404)
    return JsonResponse({"customer": customer_id, "orders": stats.orders,
                         "total_cents": stats.total_cents})
