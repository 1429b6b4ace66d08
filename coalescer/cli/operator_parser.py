"""The arguments of ``coalescer keys`` (search and bulk actions) and ``coalescer audit``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from coalescer.query.key_search import STATES


def _positive(most: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= most:
            raise argparse.ArgumentTypeError(f"a whole number from 1 to {most}, got {value!r}")
        return int(value)
    return parse


def _rate(value: str) -> int:
    if not value.isascii() or not value.isdigit():
        raise argparse.ArgumentTypeError(f"keys a second, a whole number (0: no limit), "
                                         f"got {value!r}")
    return int(value)


def add_operator_commands(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """``keys`` and ``audit``; ``common`` adds --rules, --redis and -v."""
    keys = sub.add_parser("keys", help="a rule's keys by capture and state, a page at a "
                                       "time; with an action flag, act on all of them")
    common(keys)
    keys.add_argument("--rule", required=True, metavar="RULE", help="the rule whose keys to find")
    keys.add_argument("--where", action="append", metavar="CAPTURE=VALUE",
                      help="only keys whose capture CAPTURE is VALUE (repeat: all must hold)")
    keys.add_argument("--state", metavar="STATE",
                      help=f"one of {', '.join(STATES)} (default: pending; dead for --retry "
                           "and --purge)")
    keys.add_argument("-n", "--limit", type=_positive(100_000), default=50, metavar="N",
                      help="keys to list at most (default 50)")
    keys.add_argument("--cursor", metavar="CURSOR", help="go on where a listing stopped")
    for flag, text in (("--run-now", "make every key found due now"),
                       ("--retry", "re-queue every dead key found"),
                       ("--cancel", "drop the pending refresh of every key found"),
                       ("--purge", "delete every dead key found for good")):
        keys.add_argument(flag, action="store_true", help=text)
    keys.add_argument("--dry-run", action="store_true", help="count the keys an action "
                      "would act on, change nothing (the default without --yes)")
    keys.add_argument("--yes", action="store_true", help="act: without it an action only "
                      "counts")
    keys.add_argument("--rate", type=_rate, metavar="N", help="keys acted on per second at "
                      "most (default 10000; 0: no limit)")
    keys.add_argument("--json", action="store_true", help="machine-readable output")
    audit = sub.add_parser("audit", help="operator actions: who did what, when, how many")
    common(audit)
    audit.add_argument("-n", "--limit", type=_positive(1000), default=50, metavar="N",
                       help="entries to show, newest first (1 to 1000, default 50)")
    audit.add_argument("--before", metavar="ID", help="entries older than this entry id "
                                                      "(the next page)")
    audit.add_argument("--json", action="store_true", help="machine-readable output")
