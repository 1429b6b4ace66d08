"""The shop's two URLs: place an order, read a customer's stats."""

from __future__ import annotations

from django.urls import path

from . import views

urlpatterns = [
    path("orders/", views.place_order),
    path("customers/<int:customer_id>/stats", views.customer_stats),
]
