"""``coalescer timeline KEY [--at T] [--trace-url TEMPLATE] [--json]``: a key's recent
events (touches by the second, schedules, claims, outcomes), and with ``--at`` which
refresh covered a write made then."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from coalescer.coalescer import Coalescer
from coalescer.common.printable import printable
from coalescer.errors import InvalidKeyError, UnknownKeyError
from coalescer.query.timeline import parse_at
from coalescer.query.timeline_text import format_timeline
from coalescer.query.trace_links import ENV_TRACE_URL, check_template

EXIT_KEY = 2  # as touch and explain: a key no rule matches, or one that cannot be stored


def _at(value: str) -> int:
    try:
        return parse_at(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _template(value: str) -> str:
    try:
        return check_template(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_timeline_command(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    timeline = sub.add_parser("timeline", help="a key's recent events, and which refresh "
                                               "covered a write at a given time")
    common(timeline)
    timeline.add_argument("key", metavar="KEY")
    timeline.add_argument("--at", type=_at, default=None, metavar="T",
                          help="a write's time (epoch seconds, or ISO 8601: local time "
                               "unless it has an offset): say which refresh covered it")
    timeline.add_argument("--trace-url", type=_template, default=None, metavar="TEMPLATE",
                          help="trace links, e.g. 'https://jaeger/trace/{trace_id}' "
                               f"(default: ${ENV_TRACE_URL})")
    timeline.add_argument("--json", action="store_true", help="machine-readable output")


def trace_template(given: str | None) -> str | None:
    """The template given, else $COALESCER_TRACE_URL (ValueError when that one is bad)."""
    if given is not None:
        return given
    env = os.environ.get(ENV_TRACE_URL) or None
    return None if env is None else check_template(env)


async def timeline_command(args: argparse.Namespace, c: Coalescer) -> int:
    """``coalescer timeline`` on ``c`` (not started)."""
    try:
        template = trace_template(args.trace_url)
    except ValueError as exc:
        print(f"coalescer timeline: ${ENV_TRACE_URL}: {exc}", file=sys.stderr)
        return 1
    try:
        c.config.rule_for(args.key)
    except UnknownKeyError:
        print(f"coalescer timeline: no rule in {args.rules} matches key "
              f"{printable(args.key)!r}", file=sys.stderr)
        return EXIT_KEY
    except InvalidKeyError as exc:
        print(f"coalescer timeline: {exc}", file=sys.stderr)
        return EXIT_KEY
    async with c:
        info = await c.query.timeline(args.key, at_ms=args.at, trace_url=template)
    print(json.dumps(info, indent=2) if args.json else format_timeline(info))
    return 0
