"""Django for the tests: settings configured once per process, on a SQLite file, with
the outbox app installed and migrated (every Django test module shares them)."""

from __future__ import annotations

from pathlib import Path

import django
from django.conf import settings
from django.core.management import call_command


def configure(folder: Path) -> None:
    """Configure Django (once per process) and migrate the outbox app."""
    if not settings.configured:
        settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                                  "NAME": str(folder / "app.sqlite3")}},
                           INSTALLED_APPS=["coalescer.integrations.django"], USE_TZ=True)
        django.setup()
        call_command("migrate", "coalescer", verbosity=0)
