"""One log line per operator action (pause, resume, run-now, cancel, retry, dead purge),
naming the action, its target, how many it changed, and who asked.

Who (the local user; over HTTP, the token's name) and where the lines go:
docs/cli.md, "audit". The lines go to the logger ``coalescer.common.audit_log`` at INFO;
keys and rule names are escaped (``common.printable``): no key can forge a line.

Given a ``sink`` (a coalescer's ``audit``: ``store/audit_stream.py``), each action is
also written to the namespace's audit log, a capped Redis stream that ``coalescer
audit``, ``GET /audit`` and the page show. Writing it never fails the action: a write
that fails is logged (once a minute at most) and counted (``write_failures()``).
"""

from __future__ import annotations

import getpass
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coalescer.common.log_once import LogOnce
from coalescer.common.plural import plural
from coalescer.common.printable import printable

log = logging.getLogger(__name__)

SHOWN_KEYS = 5  # keys named in one line; the rest are counted
_failed_lines = LogOnce(log)
_failures = [0]


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One operator action: ``who`` did ``action`` to ``target``, changing ``done``
    things (``detail``: anything more, such as a bulk action's filters)."""

    action: str
    target: str
    done: int
    who: str
    detail: str = ""


class AuditSink(Protocol):
    """Where entries go besides the log line (``store/audit_stream.AuditStream``):
    ``record`` must not block; it may fail, which never fails the action."""

    def record(self, entry: AuditEntry) -> None: ...


def write_failed(exc: BaseException) -> None:
    """Count an audit entry that could not be written, and say so (once a minute)."""
    _failures[0] += 1
    _failed_lines.warning(type(exc).__name__, "an operator action could not be written to "
                          "the audit log (the action itself was done): %r", exc)


def write_failures() -> int:
    """Audit entries this process could not write, so far."""
    return _failures[0]


def local_user() -> str:
    """Who runs this process: ``local user NAME (uid N)``."""
    uid = os.getuid()
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container's bare uid)
        return f"local user uid {uid}"
    return f"local user {printable(name)} (uid {uid})"


def http_caller(*, token: bool, peer: str | None, name: str | None = None) -> str:
    """Who sent an HTTP request: ``token NAME`` (the name of the token it sent), ``token``
    (it was required, so the caller holds it), or ``anonymous from PEER``."""
    if name:
        return f"token {printable(name)}"
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


def operator_action(action: str, target: str, done: int, who: str, *,  # noqa: PLR0913
                    sink: AuditSink | None = None, detail: str = "") -> None:
    """Log that ``who`` did ``action`` to ``target``, which changed ``done`` things;
    with a ``sink``, write it to the audit log too (never raising)."""
    log.info("operator action: %s %s: %d changed, by %s", action, target, done, who)
    if sink is None:
        return
    try:
        sink.record(AuditEntry(action, target, done, who, detail))
    except Exception as exc:  # the action was done: the entry must not undo that
        write_failed(exc)
