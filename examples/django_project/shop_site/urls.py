"""The project's URLs: the shop's."""

from __future__ import annotations

from django.urls import include, path

urlpatterns = [path("", include("shop.urls"))]
