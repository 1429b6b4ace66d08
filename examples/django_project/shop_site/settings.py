"""Settings of the example project: one app (``shop``), SQLite, and coalescer's app.

The database file is ``$SHOP_DB``, else ``db.sqlite3`` beside this project.
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-only-not-a-secret"  # an example project: make your own
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "coalescer.integrations.django",  # manage.py coalescer, and the outbox table
    "shop",
]

MIDDLEWARE: list[str] = []
ROOT_URLCONF = "shop_site.urls"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB") or BASE_DIR / "db.sqlite3",
    },
}

USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# coalescer: the rules file of `manage.py coalescer ...` and of get_coalescer().
# The Redis server is $COALESCER_REDIS_URL, else the embedded one.
COALESCER_RULES = BASE_DIR / "rules.yaml"
