"""Orders placed through the view refresh their customer's stats: the view, the touch
on commit and the ORM handler, each test in a namespace of its own."""

from __future__ import annotations

import pytest
from django.test import Client

from coalescer.integrations.django import drain
from coalescer.testing import assert_refreshed

# The handler runs on a connection of its own: it sees only committed data.
pytestmark = pytest.mark.django_db(transaction=True)


def test_orders_refresh_their_customers_stats_once(client: Client) -> None:
    for total_cents in (1250, 50):
        placed = client.post("/orders/", {"customer": 7, "total_cents": total_cents})
        assert placed.status_code == 201
    assert client.get("/customers/7/stats").status_code == 404  # not refreshed yet
    assert_refreshed(drain(), ["stats:customer:7"], exactly_once=True)
    assert client.get("/customers/7/stats").json() == {
        "customer": 7, "orders": 2, "total_cents": 1300}


def test_a_refused_order_touches_nothing(client: Client) -> None:
    assert client.post("/orders/", {"customer": 7}).status_code == 400
    assert drain() == []
