"""What a Kafka source says when its group refuses, or does not answer, a commit, and
when Redis does not take a batch's touches in time (the lines an operator sees:
docs/sources.md, "Rebalances"). A refused commit (aiokafka's ``CommitFailedError``) is
named by its cause as the group coordinator gave it, never with aiokafka's advice about
``max_poll_interval_ms``, and without aiokafka's own error line per partition for those
causes (a filter on its coordinator's logger drops them). A commit the coordinator does
not answer in time raises ``CommitTimeoutError``, naming the group and the wait.
"""

from __future__ import annotations

import logging

from coalescer.common.log_once import LogOnce

log = logging.getLogger("coalescer.sources.kafka")
_once = LogOnce(log)

# the coordinator's error (aiokafka's class name) -> what it means, in a few words
CAUSES = {
    "RebalanceInProgressError": "a rebalance of the group is in progress",
    "UnknownMemberIdError": "the group does not know this member (it left, or its "
                            "session ended)",
    "IllegalGenerationError": "the group has rebalanced since this member joined",
}
UNKNOWN_CAUSE = "the group has rebalanced"


class _GroupErrorLines(logging.Filter):
    """Drops aiokafka's line per partition of a commit refused for a group error: the
    source logs one line for the whole commit (``log_refused``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("OffsetCommit failed for group %s due to group")


logging.getLogger("aiokafka.consumer.group_coordinator").addFilter(_GroupErrorLines())


class CommitTimeoutError(Exception):
    """The group coordinator did not answer a commit in time (not a TimeoutError: the
    broker answers, the group does not)."""


def refusal_cause(exc: BaseException) -> str:
    """Why the group refused a commit, from the coordinator's error behind ``exc``."""
    cause = exc.__cause__ or exc.__context__
    return CAUSES.get(type(cause).__name__, UNKNOWN_CAUSE) if cause else UNKNOWN_CAUSE


def log_refused(source: str, group: str, exc: BaseException, *, looping: bool) -> None:
    """One line for a commit the group refused (rate-limited per source and cause)."""
    cause = refusal_cause(exc)
    then = ("the partitions' next owner reads the batch again" if looping else
            "this drain touched the messages already; the group's members read them again")
    _once.warning(f"{source}|{group}|commit|{cause}", "source %s: commit refused by group %r: %s; "
                  "%s", source, group, cause, then)


def commit_timeout(source: str, group: str, seconds: float) -> CommitTimeoutError:
    """The error of a commit the coordinator of ``group`` left unanswered."""
    return CommitTimeoutError(
        f"source {source}: group {group!r} did not answer a commit within {seconds:g}s "
        "(the broker answers; its group coordinator may be loading or rebalancing)")


class FlushTimeoutError(Exception):
    """Redis did not take a batch's touches in time: the batch is not committed."""


def flush_timeout(source: str, seconds: float) -> FlushTimeoutError:
    """The error of a batch whose flush to Redis did not end in time (the Kafka loop
    logs it as one line, and reads the batch again)."""
    return FlushTimeoutError(
        f"source {source}: Redis did not take the batch's touches within {seconds:g}s; "
        "the batch is not committed and is read again")
