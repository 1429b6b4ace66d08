"""Touch keys once a database transaction commits: SQLAlchemy and Django helpers.

Each lives in a module of its own (``coalescer.integrations.sqlalchemy``,
``coalescer.integrations.django``) that needs its library, installed with the
matching extra (``pip install 'coalescer[sqlalchemy]'`` or ``'coalescer[django]'``).
``coalescer.integrations.asgi`` runs an app's coalescer with a Starlette or FastAPI
app's lifespan (it needs Starlette, which such an app has).

Beside the façade: may import ``coalescer.sync``, ``coalescer.store`` and the layers
below it; never the worker, the web or the CLI.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from coalescer.store.keycheck import check_key


class Toucher(Protocol):
    """A ``Coalescer`` or a ``SyncCoalescer``: anything with ``touch(key)``."""

    def touch(self, key: str) -> None: ...


def checked_keys(coalescer: Toucher, keys: Iterable[str]) -> list[str]:
    """``keys`` as a list, once each is known to be storable and matched by a rule.

    Raises InvalidKeyError or UnknownKeyError naming the key at the call site, not
    later in a commit hook, where the transaction is already committed.
    """
    out = list(keys)
    config: Any = getattr(coalescer, "config", None)
    if config is None:
        config = getattr(getattr(coalescer, "coalescer", None), "config", None)
    for key in out:
        check_key(key)
        if config is not None:
            config.rule_for(key)
    return out
