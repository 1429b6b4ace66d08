"""The `coalescer` command's arguments: every subcommand, its options and their help."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from coalescer import __version__
from coalescer.cli.fair_cmd import add_fair_command
from coalescer.cli.operator_parser import add_operator_commands
from coalescer.cli.timeline_cmd import add_timeline_command
from coalescer.config.durations import parse_duration

DEFAULT_HTTP = "127.0.0.1:8470"


DESCRIPTION = ("Debounce and coalesce refreshes of aggregates across processes and nodes, "
               "on Redis.")


RULES_METAVAR = "PATH|MODULE:ATTR"
IN_CODE = "; or module.path:attribute, a Rules(...) built in code"


def _common(parser: argparse.ArgumentParser, *, rules_default: str | None = "./rules.yaml",
            rules_help: str = "rules file (default ./rules.yaml)" + IN_CODE) -> None:
    parser.add_argument("--rules", default=rules_default, metavar=RULES_METAVAR,
                        help=rules_help)
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default $COALESCER_REDIS_URL, else the embedded server)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (default: INFO for run and demo; other commands "
                             "print only their answer and errors)")


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, without breaking a word at a hyphen or in its middle: a default
    path such as /srv/my-app/rules.yaml stays whole, to be copied."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                             break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser (and its subcommands' parsers) with that help formatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(prog: str = "coalescer") -> argparse.ArgumentParser:
    """Every subcommand; ``prog`` names the command in usage and help lines
    (``manage.py coalescer`` under Django)."""
    p = _Parser(prog=prog, description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"coalescer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a node: absorb, elect, poll, refresh")
    _common(run)
    run.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                     help=f"HTTP API address (default {DEFAULT_HTTP}; 'off' disables it)")
    run.add_argument("--insecure-no-token", action="store_true", dest="open_http",
                     help="serve the HTTP API on an address that is not loopback without "
                          "COALESCER_TOKEN (refused otherwise); anyone who reaches it can "
                          "touch keys and read status")
    _http_limits(run)
    run.add_argument("--node-id", default=None, metavar="ID", help="node id (default HOST:PID)")
    run.add_argument("--grace", type=_grace, default=30.0, metavar="SECONDS",
                     help="how long SIGTERM waits for running refreshes (default 30)")
    run.add_argument("--processes", type=_count, default=1, metavar="N",
                     help="node processes to run and supervise (default 1); child k gets "
                          "node id ID-k with --node-id and HTTP port PORT+k")
    run.add_argument("-q", "--quiet", action="store_true",
                     help="no line per refresh (the node still logs its start, a summary "
                          "every 10 s in which it refreshed, warnings and errors)")
    touch = sub.add_parser("touch", help="touch keys; exits once Redis holds them")
    _common(touch)
    touch.add_argument("keys", nargs="+", metavar="KEY")
    touch.add_argument("--item", action="append", default=[], dest="items", metavar="ITEM",
                       help="touch every KEY with this item (repeatable; the keys' rules "
                            "need items:), delivered in claim.items")
    when = touch.add_mutually_exclusive_group()
    when.add_argument("--at", default=None, metavar="ISO-8601",
                      help="make every KEY due at exactly this time, with its offset "
                           "(2026-12-05T12:00:00+00:00), instead of a window after now")
    when.add_argument("--delay", default=None, metavar="DURATION",
                      help="make every KEY due this long from now (30m, 1.5s, 2h, or "
                           "seconds), by the Redis server's clock")
    touch.add_argument("--priority", default=None, metavar="DURATION",
                       help="among due keys, claim every KEY as if due this much earlier "
                            "(30s, 2m; its rule needs priority: or fair:)")
    _json_flag(touch)
    check = sub.add_parser("check", help="validate a rules file (or rules built in code)")
    check.add_argument("path", nargs="?", default=None, metavar=RULES_METAVAR)
    check.add_argument("--rules", default="./rules.yaml", metavar=RULES_METAVAR, dest="rules",
                       help="rules file (default ./rules.yaml; PATH, if given, is used)"
                            + IN_CODE)
    check.add_argument("-v", "--verbose", action="store_true",
                       help="also say how each Python handler runs and where it is defined, "
                            "with debug logging")
    check.add_argument("--no-import", action="store_false", dest="import_handlers",
                       help="check the handlers' names only: import no handler module "
                            "(none of their code runs)")
    _json_flag(check)
    status = sub.add_parser("status", help="leaders, pending, in flight, dead letters")
    _common(status)
    _json_flag(status)
    status.add_argument("--shards", "--all", action="store_true", dest="all_shards",
                        help="list every shard and its leader (default: a summary)")
    retry = sub.add_parser("retry", help="re-queue dead-lettered keys")
    _common(retry)
    retry.add_argument("keys", nargs="*", metavar="KEY")
    retry.add_argument("--all", action="store_true", help="re-queue every dead key")
    _json_flag(retry)
    _add_scheduled(sub)
    _add_controls(sub)
    demo = sub.add_parser("demo", help="a self-contained showcase on the embedded server")
    _common(demo, rules_default=None,
            rules_help="rules file (default: the demo's own, shipped with coalescer)")
    _add_inspection(sub)
    add_operator_commands(sub, _common)
    add_fair_command(sub, _common)
    add_timeline_command(sub, _common)
    return p


def _add_scheduled(sub: Any) -> None:
    """cancel (by key, or a rule's keys scheduled after a time) and scheduled."""
    cancel = sub.add_parser("cancel", help="drop keys' pending refreshes (by key, or the "
                                           "keys of a rule scheduled after a time)")
    _common(cancel)
    cancel.add_argument("keys", nargs="*", metavar="KEY")
    cancel.add_argument("--rule", metavar="RULE", help="with --scheduled-after: the rule "
                        "whose scheduled keys are cancelled")
    cancel.add_argument("--scheduled-after", metavar="TIME", help="cancel every key of "
                        "--rule scheduled (at/delay) after TIME: ISO-8601 with an offset, or "
                        "epoch seconds; read a page at a time, never blocking Redis")
    cancel.add_argument("--dry-run", action="store_true",
                        help="with --scheduled-after: count them, cancel nothing")
    _json_flag(cancel)
    scheduled = sub.add_parser("scheduled", help="keys scheduled by at/delay, soonest first")
    _common(scheduled)
    scheduled.add_argument("--rule", metavar="RULE", help="only this rule's keys")
    scheduled.add_argument("-n", "--limit", type=_shown_count, default=20, metavar="N",
                           help="how many keys to list (1 to 10000, default 20)")
    _json_flag(scheduled)


def _add_controls(sub: Any) -> None:
    """pause, resume and run-now: an operator's controls."""
    for action, text in (("pause", "pause a rule on every node: its keys collect touches "
                                   "and none runs until it is resumed"),
                         ("resume", "resume a paused rule: its due keys run at once")):
        p = sub.add_parser(action, help=text)
        _common(p)
        p.add_argument("rule", metavar="RULE")
        _json_flag(p)
    run_now = sub.add_parser("run-now", help="run pending keys now: their window skipped")
    _common(run_now)
    run_now.add_argument("keys", nargs="+", metavar="KEY")
    _json_flag(run_now)


def _http_limits(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("HTTP connection limits")
    for flag, dest, kind, text in HTTP_LIMITS:
        group.add_argument(flag, type=kind, default=None, dest=f"http_{dest}",
                           metavar="N" if dest == "max_connections" else "SECONDS", help=text)


def http_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The HTTP limits given on the command line, as HttpApi keywords."""
    given = {dest: getattr(args, f"http_{dest}", None) for _, dest, _, _ in HTTP_LIMITS}
    return {dest: value for dest, value in given.items() if value is not None}


def http_limit_argv(args: argparse.Namespace) -> list[str]:
    """The HTTP limits given on the command line, as arguments again (for children)."""
    limits = http_limits(args)
    return [part for flag, dest, _, _ in HTTP_LIMITS if dest in limits
            for part in (flag, repr(limits[dest]))]


def _connections(value: str) -> int:
    """An argparse type for --http-max-connections: a whole number of 2 or more (one
    connection is kept for /healthz)."""
    if not value.isdigit() or int(value) < 2:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of 2 or more (one is kept for /healthz), not {value!r}")
    return int(value)


def _seconds(value: str) -> float:
    """An argparse type: a duration over 0 ("10", "2.5", "10s", "1m")."""
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds over 0 (or 10s, 1m), not {value!r}")
    return seconds


# the HTTP API's connection limits: (flag, HttpApi keyword, argparse type, help)
HTTP_LIMITS: tuple[tuple[str, str, Any, str], ...] = (
    ("--http-max-connections", "max_connections", _connections,
     "connections open at once (default: half the file limit less 64, from 8 to 1024); "
     "at the cap the oldest idle or unfinished one is closed to make room"),
    ("--http-header-timeout", "header_timeout", _seconds,
     "seconds a request's headers may take to arrive (default 10)"),
    ("--http-body-timeout", "body_timeout", _seconds,
     "seconds a request's body may take to arrive (default 30): 408 after it"),
    ("--http-idle-timeout", "idle_timeout", _seconds,
     "seconds an idle kept-alive connection stays open (default 30)"),
)


def _count(value: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, not {value!r}")
    return int(value)


def _shown_count(value: str) -> int:
    """An argparse type: a whole number from 1 to 10000 (keys listed)."""
    count = _count(value)
    if count > 10_000:
        raise argparse.ArgumentTypeError(f"must be at most 10000, not {value!r}")
    return count


def _grace(value: str) -> float:
    """An argparse type for --grace: a duration of 0 or more ("30", "1.5", "30s", "2m")."""
    try:
        return parse_duration(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds of 0 or more (or 30s, 2m), not {value!r}") from None


def _offset(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of 0 or more, not {value!r}")
    return int(value)


def _add_inspection(sub: Any) -> None:
    """explain, history and dead: looking into keys, refreshes and dead letters."""
    explain = sub.add_parser("explain", help="a key's rule, state and why, last refreshes")
    _common(explain)
    explain.add_argument("key", metavar="KEY")
    _json_flag(explain)
    history = sub.add_parser("history", help="recent refreshes, newest first")
    _common(history)
    history.add_argument("--rule", default=None, metavar="R", help="only refreshes of rule R")
    history.add_argument("--key", default=None, metavar="K", help="only refreshes of key K")
    history.add_argument("--failed", action="store_true",
                         help="only failed, timed-out or lost refreshes")
    history.add_argument("-n", type=_count, default=20, metavar="N",
                         help="how many refreshes at most (default 20)")
    _json_flag(history)
    dead = sub.add_parser("dead", help="dead letters: list, retry (re-queue) or purge")
    actions = dead.add_subparsers(dest="action", required=True)
    helps = {"list": "list dead letters, oldest first, with the total",
             "retry": "re-queue dead keys, due now, with fresh attempts",
             "purge": "delete dead keys for good"}
    for action, text in helps.items():
        p = actions.add_parser(action, help=text)
        _common(p)
        p.add_argument("keys", nargs="*", metavar="KEY")
        p.add_argument("--all", action="store_true", help="every dead key")
        p.add_argument("--rule", default=None, metavar="R", help="every dead key of rule R")
        if action == "list":
            p.add_argument("--limit", type=_count, default=20, metavar="N",
                           help="dead letters per page (default 20)")
            p.add_argument("--offset", type=_offset, default=0, metavar="N",
                           help="dead letters to skip, oldest first (default 0)")
        _json_flag(p)
