"""The `coalescer` command line: run a node, touch keys, look into state and dead letters."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from coalescer import __version__
from coalescer.cli.errors import check_redis_url, http_address, redis_failure
from coalescer.coalescer import Coalescer
from coalescer.common.plural import plural
from coalescer.common.redact import redact
from coalescer.config.durations import parse_duration
from coalescer.config.rules import Config, check_file
from coalescer.errors import CoalescerError, ConfigError, shown_key
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.store.keycheck import key_problem

log = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_UNKNOWN_KEY = 2
DEFAULT_HTTP = "127.0.0.1:8470"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DESCRIPTION = ("Debounce and coalesce refreshes of aggregates across processes and nodes, "
               "on Redis.")
SERVICES = ("run", "demo")  # they log at INFO by default; one-shot commands at WARNING


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rules", default="./rules.yaml", metavar="PATH",
                        help="rules file (default ./rules.yaml)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default $COALESCER_REDIS_URL, else the embedded server)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (default: INFO for run and demo; other commands "
                             "print only their answer and errors)")


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")




def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coalescer", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"coalescer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a node: absorb, elect, poll, refresh")
    _common(run)
    run.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                     help=f"HTTP API address (default {DEFAULT_HTTP}; 'off' disables it)")
    run.add_argument("--node-id", default=None, metavar="ID", help="node id (default HOST:PID)")
    run.add_argument("--grace", type=_grace, default=30.0, metavar="SECONDS",
                     help="how long SIGTERM waits for running refreshes (default 30)")
    run.add_argument("--processes", type=_count, default=1, metavar="N",
                     help="node processes to run and supervise (default 1); child k gets "
                          "node id ID-k with --node-id and HTTP port PORT+k")
    touch = sub.add_parser("touch", help="touch keys; exits once Redis holds them")
    _common(touch)
    touch.add_argument("keys", nargs="+", metavar="KEY")
    _json_flag(touch)
    check = sub.add_parser("check", help="validate a rules file")
    check.add_argument("path", nargs="?", default=None, metavar="PATH")
    check.add_argument("--rules", default="./rules.yaml", metavar="PATH", dest="rules")
    check.add_argument("--redis", default=None, metavar="URL", help="(unused)")
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
    demo = sub.add_parser("demo", help="a self-contained showcase on the embedded server")
    _common(demo)
    _add_inspection(sub)
    return p


def _count(value: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, not {value!r}")
    return int(value)


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


def _client(args: argparse.Namespace, **options: Any) -> Coalescer:
    return Coalescer.from_yaml(args.rules, redis_url=args.redis, **options)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working folder when that is short, else absolute."""
    relative = os.path.relpath(path)
    if not relative.startswith(".."):
        return f"./{relative}"
    return relative if relative.count("..") <= 2 else str(path)


def _using(args: argparse.Namespace, c: Coalescer) -> str:
    """Which server ``c`` uses, e.g. "using redis://:***@host:6379/0 (from --redis)"."""
    url = redact(c.redis_url or "")
    if c.embedded_root is not None:
        return f"using the embedded server at {_shown_path(c.embedded_root)} ({url})"
    return f"using {url} (from {'--redis' if args.redis else '$' + ENV_REDIS_URL})"


def _say_using(args: argparse.Namespace, c: Coalescer) -> None:
    """One stderr line naming the server: always for the embedded one (whose folder
    matters), else only with -v (the user named the server)."""
    if c.embedded_root is None and not getattr(args, "verbose", False):
        return
    print(f"coalescer {args.command}: {_using(args, c)}", file=sys.stderr, flush=True)


def _refuse_unstorable(keys: list[str]) -> bool:
    """Print one line for the keys Redis cannot store (bytes that are not UTF-8 in
    argv, a NUL, over the length limit); True if there are any."""
    bad = [(key, problem) for key in keys if (problem := key_problem(key)) is not None]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        print(f"coalescer touch: key {shown_key(bad[0][0])} cannot be stored: {bad[0][1]}"
              f"{more}; nothing was touched", file=sys.stderr)
    return bool(bad)


async def cmd_touch(args: argparse.Namespace) -> int:
    if _refuse_unstorable(args.keys):
        return EXIT_UNKNOWN_KEY
    c = _client(args, worker=False)
    unknown = c.unknown_keys(args.keys)
    if unknown:
        for key in unknown:
            print(f"coalescer touch: no rule in {args.rules} matches key {key!r}",
                  file=sys.stderr)
        print("coalescer touch: nothing was touched", file=sys.stderr)
        return EXIT_UNKNOWN_KEY
    async with c:
        _say_using(args, c)
        for key in args.keys:
            c.touch(key)
        await c.flush()
    print(json.dumps({"touched": len(args.keys)}) if args.json
          else f"touched {plural(len(args.keys), 'key')}")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from coalescer.query.status import format_status
    async with _client(args, worker=False) as c:
        _say_using(args, c)
        status = await c.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status, int(time.time() * 1000), every_shard=args.all_shards))
    return 0


async def cmd_retry(args: argparse.Namespace) -> int:
    if not args.keys and not args.all:
        print("coalescer retry: name KEYs or pass --all", file=sys.stderr)
        return EXIT_ERROR
    if args.keys and args.all:
        print("coalescer retry: name KEYs or pass --all, not both", file=sys.stderr)
        return EXIT_ERROR
    c = _client(args, worker=False)
    unknown = c.unknown_keys(args.keys)
    if unknown:
        print(f"coalescer retry: no rule matches {', '.join(map(repr, unknown))}",
              file=sys.stderr)
        return EXIT_UNKNOWN_KEY
    async with c:
        _say_using(args, c)
        outcome = await c.retry_dead_letters(None if args.all else args.keys)
    _say_done(args, "requeued", outcome.done, outcome.not_dead)
    return _report_not_dead("retry", outcome.not_dead, "nothing to re-queue")


def _say_done(args: argparse.Namespace, what: str, done: int, not_dead: list[str]) -> None:
    """"re-queued 2 dead-lettered keys", or its JSON ({"requeued": 2, "not_dead": []})."""
    if args.json:
        print(json.dumps({what: done, "not_dead": not_dead}))
        return
    verb = "re-queued" if what == "requeued" else what
    print(f"{verb} {plural(done, 'dead-lettered key')}")


def _report_not_dead(command: str, keys: list[str], consequence: str) -> int:
    for key in keys:
        print(f"coalescer {command}: {key!r} is not dead-lettered; {consequence}",
              file=sys.stderr)
    return EXIT_ERROR if keys else 0


def _unknown_key(command: str, args: argparse.Namespace, c: Coalescer, keys: list[str]) -> bool:
    unknown = c.unknown_keys(keys)
    for key in unknown:
        print(f"coalescer {command}: no rule in {args.rules} matches key {key!r}",
              file=sys.stderr)
    return bool(unknown)


def _unknown_rule(command: str, args: argparse.Namespace, c: Coalescer) -> bool:
    if args.rule is None or args.rule in {r.name for r in c.config.rules}:
        return False
    names = ", ".join(r.name for r in c.config.rules)
    print(f"coalescer {command}: no rule named {args.rule!r} in {args.rules} "
          f"(its rules: {names})", file=sys.stderr)
    return True


async def cmd_explain(args: argparse.Namespace) -> int:
    from coalescer.query.explain import format_explain
    c = _client(args, worker=False)
    if _unknown_key("explain", args, c, [args.key]):
        return EXIT_UNKNOWN_KEY
    async with c:
        info = await c.explain(args.key)
    print(json.dumps(info, indent=2) if args.json else format_explain(info))
    return 0


async def cmd_history(args: argparse.Namespace) -> int:
    from coalescer.query.history import HistoryQuery, format_history
    c = _client(args, worker=False)
    if _unknown_rule("history", args, c):
        return EXIT_ERROR
    if args.key is not None and _unknown_key("history", args, c, [args.key]):
        return EXIT_UNKNOWN_KEY
    query = HistoryQuery(rule=args.rule, key=args.key, failed=args.failed, limit=args.n)
    async with c:
        found = await c.history(query)
    if args.json:
        print(json.dumps([r.to_json() for r in found], indent=2))
    else:
        print(format_history(found))
    return 0


async def cmd_dead(args: argparse.Namespace) -> int:
    what = "dead " + args.action
    if args.keys and (args.all or args.rule):
        print(f"coalescer {what}: name KEYs or pass --all / --rule, not both", file=sys.stderr)
        return EXIT_ERROR
    if args.action != "list" and not (args.keys or args.all or args.rule):
        print(f"coalescer {what}: name KEYs, or pass --all or --rule R", file=sys.stderr)
        return EXIT_ERROR
    c = _client(args, worker=False)
    if _unknown_rule(what, args, c):
        return EXIT_ERROR
    if _unknown_key(what, args, c, args.keys):
        return EXIT_UNKNOWN_KEY
    async with c:
        if args.action == "list":
            return await _dead_list(c, args)
        return await _dead_act(c, args, what)


async def _dead_list(c: Coalescer, args: argparse.Namespace) -> int:
    from coalescer.query.dead_letters import format_dead_page
    page = await c.dead_letters(args.keys or None, rule=args.rule, limit=args.limit,
                                offset=args.offset)
    print(json.dumps(page.to_json(), indent=2) if args.json else format_dead_page(page))
    return _report_not_dead("dead list", page.not_dead, "nothing to show")


async def _dead_act(c: Coalescer, args: argparse.Namespace, what: str) -> int:
    keys = args.keys or None
    if args.action == "retry":
        outcome = await c.retry_dead_letters(keys, rule=args.rule)
        _say_done(args, "requeued", outcome.done, outcome.not_dead)
        return _report_not_dead(what, outcome.not_dead, "nothing to re-queue")
    outcome = await c.purge_dead(keys, rule=args.rule)
    _say_done(args, "purged", outcome.done, outcome.not_dead)
    return _report_not_dead(what, outcome.not_dead, "nothing to purge")


async def cmd_run(args: argparse.Namespace) -> int:
    address = http_address(args.http)
    if args.processes > 1:
        from coalescer.cli.supervisor import plan_from_args, supervise
        return await supervise(plan_from_args(args, address))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = _client(args, worker=True, node_id=args.node_id, grace=args.grace)
    _refuse_unset_secrets(node.config)
    async with node as c:
        api = await _start_http(c, address)
        print(f"coalescer {c.node_id} running, {_using(args, c)}"
              + (f", HTTP on http://{address[0]}:{api.port}" if api and address else ""),
              flush=True)
        await stop.wait()
        log.info("signal received: draining")
        if api is not None:
            await api.close()
    return 0


async def _start_http(c: Coalescer, address: tuple[str, int] | None) -> Any:
    if address is None:
        return None
    from coalescer.web.api import HttpApi
    api = HttpApi(c, host=address[0], port=address[1], token=os.environ.get("COALESCER_TOKEN"))
    await api.start()
    return api


def _refuse_unset_secrets(config: Config) -> None:
    """A worker node does not start while a webhook's secret_env is unset: every
    refresh of that rule would fail and end up dead-lettered."""
    problems = config.unset_secrets(os.environ)
    if problems:
        raise ConfigError.combine(problems)


def cmd_check(args: argparse.Namespace) -> int:
    """Every error and warning of the rules file, one line each, in file order; exit 1
    when there are errors."""
    path = args.path or args.rules
    report = check_file(path, os.environ)
    if args.json:
        print(json.dumps(_check_json(path, report), indent=2))
        return EXIT_ERROR if report.errors or report.config is None else 0
    found = [(e.line or 0, str(e)) for e in report.errors]
    found += [(w.line or 0, str(w)) for w in report.warnings]
    for _, text in sorted(found, key=lambda item: item[0]):
        print(redact(text), file=sys.stderr)
    warned = f", {plural(len(report.warnings), 'warning')}" if report.warnings else ""
    if report.errors or report.config is None:
        print(f"{plural(len(report.errors), 'error')}{warned} in {path}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{report.config.source}: OK" + (f" ({warned[2:]})" if warned else ""))
    print(report.config.describe())
    return 0


def _problem(problem: Any) -> dict[str, Any]:
    return {"file": problem.file, "line": problem.line, "field": problem.field,
            "message": redact(problem.message)}


def _check_json(path: str, report: Any) -> dict[str, Any]:
    """``check --json``: ok, every error and warning, and the rules understood."""
    config = report.config
    return {"file": path, "ok": not report.errors and config is not None,
            "errors": [_problem(e) for e in report.errors],
            "warnings": [_problem(w) for w in report.warnings],
            "rules": [{"name": r.name, "match": r.pattern.source} for r in config.rules]
            if config is not None else []}


async def cmd_demo(args: argparse.Namespace) -> int:
    from coalescer.cli.demo import run_demo
    return await run_demo(args.rules, args.redis)


COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "touch": cmd_touch, "status": cmd_status, "retry": cmd_retry, "run": cmd_run,
    "demo": cmd_demo, "explain": cmd_explain, "history": cmd_history, "dead": cmd_dead,
}


class RedactingFormatter(logging.Formatter):
    """Log lines with the password of every URL in them hidden."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def _setup_logging(args: argparse.Namespace) -> None:
    """run and demo log at INFO; one-shot commands only warnings and errors. ``-v``
    shows coalescer's own DEBUG lines (other libraries stay at INFO)."""
    level = logging.INFO if args.command in SERVICES else logging.WARNING
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(LOG_FORMAT))
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else level, handlers=[handler])
    if verbose:
        logging.getLogger("coalescer").setLevel(logging.DEBUG)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    try:
        if args.command == "check":
            return cmd_check(args)
        check_redis_url(args.redis)
        return asyncio.run(COMMANDS[args.command](args))
    except ConfigError as exc:
        print(f"coalescer {args.command}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except RedisError as exc:
        print(f"coalescer {args.command}: {redis_failure(args.redis, exc)}", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, CoalescerError) as exc:
        print(f"coalescer {args.command}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
