"""`coalescer run` shows a line per refresh: the worker logs each success at DEBUG (a
process that embeds a node keeps its INFO log to a summary every 10 s), and the
command line shows those lines as INFO unless ``-q`` is given."""

from __future__ import annotations

import logging

RUNNER = "coalescer.worker.runner"  # the logger of "refreshed KEY in N ms (...)"
SUCCESS = "refreshed "  # how its success lines begin


class RefreshLines(logging.Filter):
    """A handler's filter: each refresh's success line passes as an INFO line; the
    runner's other DEBUG lines pass only with ``-v``."""

    def __init__(self, *, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != RUNNER or record.levelno != logging.DEBUG:
            return True
        if isinstance(record.msg, str) and record.msg.startswith(SUCCESS):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return True
        return self.verbose


def show_refreshes(handler: logging.Handler, *, verbose: bool) -> None:
    """Make ``handler`` show a line per refresh."""
    logging.getLogger(RUNNER).setLevel(logging.DEBUG)
    handler.addFilter(RefreshLines(verbose=verbose))
