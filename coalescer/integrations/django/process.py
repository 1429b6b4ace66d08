"""The ``SyncCoalescer`` of a Django process: ``get_coalescer()``, made and started on the
first call from ``settings.COALESCER_RULES`` with ``worker=False``, closed at exit,
started again in a forked worker, and made anew when ``$COALESCER_NAMESPACE`` or
``$COALESCER_REDIS_URL`` changes (each test's, under the pytest plugin; ``drain()`` runs
what the test touched): docs/django.md, "The coalescer of a web process".
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading

from coalescer.claim import Claim
from coalescer.coalescer import Coalescer
from coalescer.config.namespace_env import ENV_NAMESPACE
from coalescer.config.rules import Config
from coalescer.config.rules_source import is_module_ref, load_rules
from coalescer.errors import UnwrittenTouchesError
from coalescer.integrations.django.conf import rules_path
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.sync import SyncCoalescer

# what a process's coalescer was made from: the rules file, the namespace and the URL
Origin = tuple[str, str, str]


def _origin() -> Origin:
    return (str(rules_path()), os.environ.get(ENV_NAMESPACE, ""),
            os.environ.get(ENV_REDIS_URL, ""))


class _PerProcess:
    """The process's one coalescer, made under a lock by the first caller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._made: tuple[Origin, SyncCoalescer] | None = None

    def get(self) -> SyncCoalescer:
        made, wanted = self._made, _origin()
        if made is not None and made[0] == wanted and self._pid == os.getpid():
            return made[1]
        self._forked()
        with self._lock:
            made = self._made
            if made is None or made[0] != wanted:
                old = made[1] if made is not None else None
                made = self._made = (wanted, _started(wanted[0]))
                if old is not None:
                    _close(old)
            return made[1]

    def _forked(self) -> None:
        """In a process forked from the one that made the coalescer, even without
        Python's fork hooks (uwsgi without py-call-osafterfork): start it again here,
        before a touch goes into a buffer that only the parent's thread would write."""
        if self._pid == os.getpid():
            return
        self.after_fork()
        made = self._made
        if made is not None:
            made[1].start()  # parks the parent's loop; repairs a fork made without hooks

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, None
        if made is not None:
            _close(made[1])

    def after_fork(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the parent's may have been held at the fork


def _rules(ref: str) -> Config:
    """The rules ``ref`` names: a rules file, or ``module.path:attribute`` (rules built
    in code, imported now, when Django is set up); handler modules not imported."""
    if is_module_ref(ref):
        return load_rules(ref, import_handlers=False)
    return Config.from_yaml(ref, import_handlers=False)


def _started(ref: str) -> SyncCoalescer:
    coalescer = SyncCoalescer(rules=_rules(ref))
    coalescer.start()
    return coalescer


def _close(coalescer: SyncCoalescer) -> None:
    with contextlib.suppress(UnwrittenTouchesError):  # close() has logged their keys
        coalescer.close()


_PROCESS = _PerProcess()
os.register_at_fork(after_in_child=_PROCESS.after_fork)
atexit.register(_PROCESS.close)


def get_coalescer() -> SyncCoalescer:
    """This process's started ``SyncCoalescer`` (see the module doc), e.g.
    ``touch_on_commit(key, coalescer=get_coalescer())``."""
    return _PROCESS.get()


def close_coalescer() -> None:
    """Close this process's coalescer now, writing its buffered touches (it is also
    closed at exit); the next ``get_coalescer()`` makes a new one."""
    _PROCESS.close()


def drain(timeout: float = 30.0) -> list[Claim]:
    """For a test (a synchronous one, such as a pytest-django test): write what this
    process's coalescer buffered, then run every pending refresh of its rules here,
    windows skipped, as ``Coalescer.drain`` does (outbox rows included); the claims
    run, in the order they started. Their handlers use their own database connections:
    mark the test ``django_db(transaction=True)``, so that they see its data."""
    get_coalescer().flush()
    return asyncio.run(_drain(timeout))


async def _drain(timeout: float) -> list[Claim]:
    async with Coalescer(rules=_rules(str(rules_path())), worker=False) as coalescer:
        return await coalescer.drain(timeout)
