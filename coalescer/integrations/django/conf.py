"""coalescer's Django settings: ``COALESCER_RULES``, the path of the rules file, or
``"module.path:attribute"`` naming rules built in code (as ``--rules`` takes them).

Unset, the rules file is ``./rules.yaml`` in the working folder, as for the
``coalescer`` command. The Redis URL is not a setting: it is ``$COALESCER_REDIS_URL``
(else the project's embedded server), for the web processes and ``manage.py
coalescer`` alike, so the pytest plugin's per-test server and namespace apply to both.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

RULES_SETTING = "COALESCER_RULES"
DEFAULT_RULES = "./rules.yaml"


def rules_setting() -> str | None:
    """``settings.COALESCER_RULES`` as a string (a path, or ``module.path:attribute``),
    None when it is unset; ImproperlyConfigured, naming the setting, when it is neither."""
    value = getattr(settings, RULES_SETTING, None)
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ImproperlyConfigured(
            f"settings.{RULES_SETTING} must be the path of a rules file (a str or a "
            f"pathlib.Path, e.g. BASE_DIR / 'rules.yaml') or rules built in code named as "
            f"'module.path:attribute' (e.g. 'myapp.coalescing:rules'), not "
            f"{type(value).__name__} {value!r}")
    return str(os.fspath(value))


def rules_path() -> Path:
    """The rules the project uses: the setting's (a file, or ``module.path:attribute``),
    else ``./rules.yaml``."""
    return Path(rules_setting() or DEFAULT_RULES)
