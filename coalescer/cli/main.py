"""The `coalescer` command line: run a node, touch keys, look into state and dead letters."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from coalescer.cli.check_cmd import EXIT_ERROR, cmd_check
from coalescer.cli.closed_stdout import leave_quietly, stdout_closed
from coalescer.cli.commands import COMMANDS
from coalescer.cli.errors import check_redis_url, redis_failure
from coalescer.cli.parser import build_parser
from coalescer.cli.refresh_lines import show_refreshes
from coalescer.common.printable import printable, unsafe_exception
from coalescer.common.redact import redact
from coalescer.errors import CoalescerError, ConfigError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


SERVICES = ("run", "demo")  # they log at INFO by default; one-shot commands at WARNING


class RedactingFormatter(logging.Formatter):
    """Log lines with the password of every URL in them hidden, and control characters
    in the message (a key, an error text) escaped so that no line can be forged."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        # coalescer's own lines escape their keys and errors already (a backslash is
        # doubled there): only what is still unsafe is escaped here, never twice
        record.message = printable(record.message, backslashes=False)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        """A traceback as lines, unless a message in it could forge a line: then it is
        one escaped line."""
        text = super().formatException(ei)
        exc = ei[1] if ei else None
        if isinstance(exc, BaseException) and unsafe_exception(exc):
            return printable(text, backslashes=False)
        return text


def _setup_logging(args: argparse.Namespace) -> None:
    """run and demo log at INFO (run: with a line per refresh, unless ``-q``); one-shot
    commands only warnings and errors. ``-v`` shows coalescer's own DEBUG lines (other
    libraries stay at INFO)."""
    level = logging.INFO if args.command in SERVICES else logging.WARNING
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else level, handlers=[handler])
    if verbose:
        logging.getLogger("coalescer").setLevel(logging.DEBUG)
    if args.command == "run" and not getattr(args, "quiet", False):
        show_refreshes(handler, verbose=verbose)


def main(argv: Sequence[str] | None = None, *,
         parser: argparse.ArgumentParser | None = None) -> int:
    """Run the command ``argv`` names; ``parser``: build_parser()'s, adapted by a caller
    (Django's ``manage.py coalescer`` names itself and its rules file there)."""
    args = (parser or build_parser()).parse_args(argv)
    _setup_logging(args)
    try:
        code = _command(args)
        sys.stdout.flush()  # a reader that went away is found here, not at exit
    except BrokenPipeError as exc:
        if stdout_closed():
            return leave_quietly()
        print(f"coalescer {args.command}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    return code


def _command(args: argparse.Namespace) -> int:
    """Run the command; its errors as one line on stderr and exit status 1."""
    try:
        if args.command == "check":
            return cmd_check(args)
        check_redis_url(args.redis)
        return asyncio.run(COMMANDS[args.command](args))
    except ConfigError as exc:
        print(f"coalescer {args.command}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except RedisError as exc:
        print(f"coalescer {args.command}: {redis_failure(getattr(args, 'redis', None), exc)}",
              file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        raise
    except (OSError, CoalescerError) as exc:
        print(f"coalescer {args.command}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
