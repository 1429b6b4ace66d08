"""One log line per operator action (pause, resume, run-now, cancel, retry, dead purge),
naming the action, its target, how many it changed, and who asked.

Who: for the commands, the local user (``local user alice (uid 1000)``); for the HTTP
API, ``token`` when the API takes a bearer token (every caller that got through holds
it), else ``anonymous from <peer address>``. The lines go to the logger
``coalescer.common.audit_log`` at INFO: a node logs them as it logs the rest; the one-shot
commands show them with ``-v`` (or wherever the application's logging sends INFO).
Keys and rule names are escaped (``common.printable``): no key can forge a line.
"""

from __future__ import annotations

import getpass
import logging
import os
from collections.abc import Sequence

from coalescer.common.plural import plural
from coalescer.common.printable import printable

log = logging.getLogger(__name__)

SHOWN_KEYS = 5  # keys named in one line; the rest are counted


def local_user() -> str:
    """Who runs this process: ``local user NAME (uid N)``."""
    uid = os.getuid()
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container's bare uid)
        return f"local user uid {uid}"
    return f"local user {printable(name)} (uid {uid})"


def http_caller(*, token: bool, peer: str | None) -> str:
    """Who sent an HTTP request: ``token`` (it was required, so the caller holds it), or
    ``anonymous from PEER``."""
    if token:
        return "token"
    return f"anonymous from {printable(peer or 'an unknown address')}"


def keys_target(keys: Sequence[str] | None, *, rule: str | None = None) -> str:
    """The target of an action on keys: up to ``SHOWN_KEYS`` of them by name, else
    every dead key (of ``rule``)."""
    if keys is None:
        return f"every dead key of rule {printable(rule)}" if rule else "every dead key"
    shown = ", ".join(f"'{printable(key)}'" for key in keys[:SHOWN_KEYS])
    more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
    return f"{plural(len(keys), 'key')} ({shown}{more})"


def operator_action(action: str, target: str, done: int, who: str) -> None:
    """Log that ``who`` did ``action`` to ``target``, which changed ``done`` things."""
    log.info("operator action: %s %s: %d changed, by %s", action, target, done, who)
