"""``coalescer scheduled`` (list the keys scheduled by a touch's own time, soonest first)
and ``coalescer cancel --rule R --scheduled-after T`` (cancel them in bulk)."""

from __future__ import annotations

import argparse
import json
import sys

from coalescer.cli.operator_cmds import SayUsing, iso
from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import local_user
from coalescer.common.plural import plural
from coalescer.common.printable import printable
from coalescer.errors import InvalidScheduleError

EXIT_ERROR = 1  # as the other commands: an unknown rule
EXIT_REFUSED = 2  # nothing done: the arguments or the time cannot be used


def _in(ms: int) -> str:
    """How far away ``ms`` milliseconds are, shortly: 45s, 12m, 5h, 30d."""
    seconds = max(0, ms) / 1000
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


async def list_scheduled(args: argparse.Namespace, c: Coalescer,
                         say_using: SayUsing) -> int:
    """``coalescer scheduled [--rule R] [-n N] [--json]`` on ``c`` (not started)."""
    if args.rule is not None and args.rule not in {r.name for r in c.config.rules}:
        print(f"coalescer scheduled: no rule named {args.rule!r} in {args.rules}",
              file=sys.stderr)
        return EXIT_ERROR
    async with c:
        say_using(args, c)
        found = await c.query.scheduled_keys(args.rule, args.limit)
    if args.json:
        print(json.dumps(found))
        return 0
    now = found["now_ms"]
    for entry in found["keys"]:
        print(f"{iso(entry['due_ms'])}  in {_in(entry['due_ms'] - now):>5}  "
              f"{printable(entry['rule'])}  {printable(entry['key'])}")
    more = " (at least: a due set was read only in part)" if found["capped"] else ""
    print(f"{plural(len(found['keys']), 'scheduled key')} shown{more}", file=sys.stderr)
    return 0


def refuse_arguments(args: argparse.Namespace) -> bool:
    """Print why ``coalescer cancel``'s bulk form cannot run; True if it cannot."""
    if args.keys or args.rule is None or args.scheduled_after is None:
        print("coalescer cancel: give KEY... or --rule RULE --scheduled-after TIME "
              "(not both)", file=sys.stderr)
        return True
    return False


async def cancel_scheduled(args: argparse.Namespace, c: Coalescer,
                           say_using: SayUsing) -> int:
    """``coalescer cancel --rule R --scheduled-after T [--dry-run] [--json]`` on ``c``."""
    if args.rule not in {r.name for r in c.config.rules}:
        print(f"coalescer cancel: no rule named {args.rule!r} in {args.rules}",
              file=sys.stderr)
        return EXIT_ERROR
    async with c:
        say_using(args, c)
        try:
            done = await c.cancel_scheduled(args.rule, after=args.scheduled_after,
                                            dry_run=args.dry_run, who=local_user())
        except InvalidScheduleError as exc:
            print(f"coalescer cancel: --scheduled-after {args.scheduled_after!r}: "
                  f"{exc.reason}; nothing was cancelled", file=sys.stderr)
            return EXIT_REFUSED
    if args.json:
        print(json.dumps({"rule": args.rule, "scheduled_after": args.scheduled_after,
                          "dry_run": args.dry_run, "cancelled": done}))
    else:
        verb = "would cancel" if args.dry_run else "cancelled"
        print(f"{verb} {plural(done, 'scheduled key')} of rule {printable(args.rule)} "
              f"(due after {args.scheduled_after})")
    return 0
