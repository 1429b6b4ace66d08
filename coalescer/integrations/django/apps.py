"""The Django app of the outbox: ``INSTALLED_APPS += ["coalescer.integrations.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class CoalescerConfig(AppConfig):
    name = "coalescer.integrations.django"
    label = "coalescer"
    verbose_name = "coalescer outbox"
    default_auto_field = "django.db.models.BigAutoField"
