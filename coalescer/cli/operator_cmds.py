"""``coalescer keys`` (a rule's keys by capture and state, a page at a time; with an
action flag, that action on every key found) and ``coalescer audit`` (the operator
actions, newest first).

A bulk action counts first: without ``--yes`` nothing is changed and the count is
printed (``--dry-run`` says the same on purpose). With ``--yes`` it acts a page at a
time at ``--rate`` keys a second, printing its progress to stderr; Ctrl-C (or SIGTERM)
stops it once the page under way is done and says how many it did (exit 130).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import local_user, operator_action
from coalescer.common.plural import plural
from coalescer.common.printable import printable
from coalescer.query.bulk import DEFAULT_RATE, BulkProgress, action_state
from coalescer.query.key_search import MAX_LIMIT, KeyFilter, PageSize, SearchError, make_filter

EXIT_ERROR = 1
EXIT_REFUSED = 2  # the arguments cannot be used: nothing was read or done
EXIT_STOPPED = 128 + signal.SIGINT
SayUsing = Callable[[argparse.Namespace, Coalescer], None]  # the server line (commands.py)
ACTIONS = ("run_now", "retry", "cancel", "purge")
PROGRESS_EVERY = 1.0  # seconds between progress lines


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def chosen_action(args: argparse.Namespace) -> str | None:
    """The action flag given (``run-now``, ``retry``, ...), if any; SearchError for two."""
    given = [name.replace("_", "-") for name in ACTIONS if getattr(args, name, False)]
    if len(given) > 1:
        raise SearchError("action", f"--{given[0]} and --{given[1]}: give one action")
    return given[0] if given else None


def _search(args: argparse.Namespace, c: Coalescer, action: str | None) -> KeyFilter:
    state = action_state(action, args.state) if action else args.state
    return make_filter(c.config, args.rule, state=state, where=args.where or ())


async def keys_command(args: argparse.Namespace, c: Coalescer, say_using: SayUsing) -> int:
    """``coalescer keys --rule R [--where C=V ...] [--state S] [-n N] [--cursor C]`` and
    its bulk actions."""
    try:
        action = chosen_action(args)
        search = _search(args, c, action)
        if action is None and (args.dry_run or args.yes or args.rate is not None):
            raise SearchError("action", "--dry-run, --yes and --rate go with an action: "
                                        "--run-now, --retry, --cancel or --purge")
        if action is not None and args.cursor:
            raise SearchError("cursor", "--cursor pages a listing; an action goes through "
                                        "every key the filters find")
    except SearchError as exc:
        print(f"coalescer keys: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    async with c:
        say_using(args, c)
        if action is None:
            return await _list(args, c, search)
        return await _act(args, c, search, action)


async def _list(args: argparse.Namespace, c: Coalescer, search: KeyFilter) -> int:
    found: list[dict[str, Any]] = []
    cursor, examined = args.cursor, 0
    try:
        while True:
            size = PageSize(limit=min(MAX_LIMIT, args.limit - len(found)))
            page = await c.query.keys(search, cursor, size)
            found += [f.to_json() for f in page.keys]
            examined += page.examined
            cursor = page.cursor
            if page.paused is False:
                print(f"coalescer keys: rule {search.rule} is not paused: no key waits "
                      f"for a resume ({c.hints.command('pause', search.rule)} pauses it)",
                      file=sys.stderr)
            if cursor is None or len(found) >= args.limit:
                break
    except SearchError as exc:
        print(f"coalescer keys: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps({"keys": found, "examined": examined, "cursor": cursor}, indent=2))
        return 0
    for entry in found:
        captures = " ".join(f"{k}={printable(v)}" for k, v in entry["captures"].items())
        print(f"{printable(entry['key'])}  {entry['state']}  {iso(entry['at_ms'])}  {captures}")
    print(f"{plural(len(found), 'key')} ({search.describe()}), "
          f"{plural(examined, 'entry', 'entries')} read", file=sys.stderr)
    if cursor is not None:
        print(f"more: add --cursor {cursor}", file=sys.stderr)
    return 0


class _Progress:
    """A line on stderr after the first page, then at most every PROGRESS_EVERY seconds."""

    def __init__(self) -> None:
        self._last: float | None = None  # the first page's line comes at once

    def __call__(self, progress: BulkProgress) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= PROGRESS_EVERY:
            self._last = now
            print(f"coalescer keys: {progress.action}: {progress.done} done of "
                  f"{progress.matched} matched so far ({progress.examined} read)",
                  file=sys.stderr, flush=True)


async def _act(args: argparse.Namespace, c: Coalescer, search: KeyFilter, action: str) -> int:
    dry_run = args.dry_run or not args.yes
    rate = DEFAULT_RATE if args.rate is None else args.rate
    progress = BulkProgress(action, search, dry_run=dry_run, rate=rate)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, progress.stop.set)

    async def cancel(keys: list[str]) -> int:
        return (await c.cancel_many(keys)).done

    try:
        await c.query.bulk(progress, cancel, None if dry_run else _Progress())
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if not dry_run:
            operator_action(action, search.describe(), progress.done, local_user(),
                            sink=c.audit, detail=_detail(progress))
    return _report(args, progress)


def _detail(progress: BulkProgress) -> str:
    return json.dumps({"bulk": progress.status, "matched": progress.matched,
                       "rate": progress.rate})


def _report(args: argparse.Namespace, progress: BulkProgress) -> int:
    print(json.dumps(progress.to_json(), indent=2) if args.json else progress.summary())
    if progress.dry_run and not args.dry_run:
        print(f"coalescer keys: nothing was done: pass --yes to {progress.action} "
              f"{plural(progress.matched, 'key')}", file=sys.stderr)
        return EXIT_ERROR
    if progress.status == "aborted":
        print(f"coalescer keys: stopped after {progress.done} keys "
              f"({progress.matched} matched so far); run it again to go on",
              file=sys.stderr)
        return EXIT_STOPPED
    return 0


async def audit_command(args: argparse.Namespace, c: Coalescer, say_using: SayUsing) -> int:
    """``coalescer audit [-n N] [--before ID] [--json]``."""
    async with c:
        say_using(args, c)
        try:
            found = await c.query.audit(limit=args.limit, before=args.before)
        except ValueError as exc:
            print(f"coalescer audit: --{exc}", file=sys.stderr)
            return EXIT_REFUSED
    if args.json:
        print(json.dumps([r.to_json() for r in found], indent=2))
        return 0
    for r in found:
        detail = f"  {printable(r.detail)}" if r.detail else ""
        print(f"{iso(r.at_ms)}  {printable(r.who)}  {printable(r.action)} "
              f"{printable(r.target)}: {r.count} changed{detail}")
    if not found:
        print("no operator action recorded", file=sys.stderr)
    return 0
