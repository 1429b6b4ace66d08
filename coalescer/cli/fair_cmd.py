"""``coalescer fair RULE``: show a fair rule's weights and cap, or change them at runtime
(``--weight VALUE=W``, ``--max-running N``, ``--no-cap``, ``--reset``): every node's next
claim follows the change, no restart. Each change is audited."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from coalescer.common.audit_log import local_user, operator_action
from coalescer.common.printable import printable
from coalescer.query.fair_controls import (
    FairView,
    NotFairError,
    checked_change,
    fair_view,
    set_fair,
)

EXIT_ERROR = 1


def _weight(value: str) -> tuple[str, float]:
    name, eq, weight = value.rpartition("=")
    try:
        number = float(weight)
    except ValueError:
        number = float("nan")
    if not eq or not name or math.isnan(number):
        raise argparse.ArgumentTypeError(f"VALUE=WEIGHT (acme=3), got {value!r}")
    return name, number


def _cap(value: str) -> int:
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a whole number from 1, got {value!r}")
    return int(value)


def add_fair_command(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    fair = sub.add_parser("fair", help="a fair rule's weights and cap: show, or change them "
                                       "at runtime (every node, no restart)")
    common(fair)
    fair.add_argument("rule", metavar="RULE")
    fair.add_argument("--weight", action="append", type=_weight, default=[],
                      metavar="VALUE=W", help="the weight of one value of the capture "
                      "(repeat for more; others weigh 1)")
    cap = fair.add_mutually_exclusive_group()
    cap.add_argument("--max-running", type=_cap, metavar="N",
                     help="at most N runs of one group in flight, cluster-wide")
    cap.add_argument("--no-cap", action="store_true", help="no cap on a group's runs")
    fair.add_argument("--reset", action="store_true", help="drop the settings made at "
                      "runtime first: the rules file's hold again")
    fair.add_argument("--json", action="store_true", help="machine-readable output")


def _changes(args: argparse.Namespace) -> bool:
    return bool(args.weight or args.max_running or args.no_cap or args.reset)


def _show(view: FairView) -> str:
    named = ", ".join(f"{printable(v)}={w:g}" + (" (runtime)" if v in view.runtime_weights
                                                 else "")
                      for v, w in sorted(view.weights.items())) or "none"
    cap = "none" if view.max_running is None else str(view.max_running)
    return (f"rule {view.rule}: fair by {{{view.by}}}\n  weights: {named} (others 1)\n"
            f"  max_running: {cap}" + (" (runtime)" if view.runtime_cap else "")
            + " per group")


async def fair_command(args: argparse.Namespace, c: Any,
                       say_using: Callable[[argparse.Namespace, Any], None]) -> int:
    try:
        change = checked_change(dict(args.weight), 0 if args.no_cap else args.max_running,
                                args.reset)
        async with c:
            say_using(args, c)
            if _changes(args):
                view = await set_fair(c.redis, c.config, args.rule, change)
                operator_action("fair", f"rule {printable(args.rule)}", 1, local_user(),
                                sink=c.audit, detail=json.dumps(view.to_json()))
            else:
                view = await fair_view(c.redis, c.config, args.rule)
    except (KeyError, NotFairError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        print(f"coalescer fair: {message}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(view.to_json()) if args.json else _show(view))
    return 0
