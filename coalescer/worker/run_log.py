"""The runner's lines about refreshes that failed, were dead-lettered or were abandoned
at shutdown. They are logged as the runner's own lines (``coalescer.worker.runner``):
``coalescer run`` shows that logger's lines (cli/refresh_lines.py) and deployments
filter on it."""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING

from coalescer.common.plural import plural
from coalescer.common.printable import printable, unsafe_exception
from coalescer.store.script_types import Failure
from coalescer.worker.failure_log import FailureLog
from coalescer.worker.jobs import Job

if TYPE_CHECKING:
    from coalescer.worker.context import NodeContext

log = logging.getLogger("coalescer.worker.runner")

MAX_ERROR_TEXT = 200
ABANDONED_SHOWN = 20  # keys named in the line of the runs abandoned at shutdown


def error_text(exc: BaseException) -> str:
    """An error as the history and the log lines show it: its type and message, cut short."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:MAX_ERROR_TEXT]


def log_failure(failures: FailureLog, job: Job, exc: BaseException, delay_ms: int) -> None:
    """One line per kind of failure (rule and error type) per period, with its
    traceback; the others of the period are counted (see failure_log.py)."""
    left_out = failures.admit(("failed", job.rule.name, type(exc).__name__))
    if left_out is None:
        return
    claim, attempts = job.claim, job.rule.retry.attempts
    then = f"; retry in {delay_ms / 1000:g}s" if claim.attempt < attempts else ""
    then += failures.note(left_out)
    trace = exc.__traceback__ is not None
    key, text = printable(claim.key), printable(error_text(exc))
    if trace and (key != claim.key or unsafe_exception(exc)):
        # a forged key, or a message anywhere in the traceback: it goes escaped, as
        # part of the line
        then += "; " + printable("".join(traceback.format_exception(exc)))
        trace = False
    log.warning("refresh of %s failed (attempt %d of %d): %s%s", key,
                min(claim.attempt, attempts), attempts, text, then,
                exc_info=exc if trace else None)


def log_dead(ctx: NodeContext, failures: FailureLog,
             jobs: dict[str, tuple[Job, Failure]], dead: list[str]) -> None:
    """Count the keys dead-lettered; a line per kind per period, with the command that
    re-queues the key."""
    for key in dead:
        job, failure = jobs[key]
        attempts = min(job.claim.attempt, job.rule.retry.attempts)
        ctx.metrics.rule(job.rule.name).dead_lettered += 1
        left_out = failures.admit(("dead", job.rule.name, failure.error.split(":", 1)[0]))
        if left_out is None:
            continue
        log.error("%s dead-lettered after %s: %s; re-queue with %s%s%s",
                  printable(key), plural(attempts, "attempt"), printable(failure.error),
                  printable(ctx.hints.command("dead retry", key)), ctx.hints.note,
                  failures.note(left_out))


def log_abandoned(ending: dict[str, Job]) -> None:
    """The line naming the handlers a shutdown leaves running past the grace."""
    keys = [key for key, job in ending.items() if job.ends is not None]
    if not keys:
        return
    shown = ", ".join(printable(key) for key in keys[:ABANDONED_SHOWN])
    more = len(keys) - ABANDONED_SHOWN
    log.warning("shutdown: abandoning %s still running past the grace (a thread in a "
                "handler ends with the process): %s%s", plural(len(keys), "handler"),
                shown, f" and {more} more" if more > 0 else "")
