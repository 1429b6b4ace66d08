"""The `coalescer` subcommands: what each does with its parsed arguments and what it prints."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from coalescer.cli.check_cmd import EXIT_ERROR, namespace_noted
from coalescer.cli.errors import UsageError, http_address
from coalescer.cli.parser import http_limit_argv, http_limits
from coalescer.cli.stopping import Stopping, at_once_line, still_line, waiting_line
from coalescer.cli.touch_priority import refuse_priority
from coalescer.coalescer import Coalescer
from coalescer.common.audit_log import keys_target, local_user, operator_action
from coalescer.common.plural import plural
from coalescer.common.printable import printable
from coalescer.common.redact import redact
from coalescer.config.rules import Config
from coalescer.config.rules_source import is_module_ref, load_rules
from coalescer.config.schedule import schedule_spec
from coalescer.errors import ConfigError, InvalidScheduleError
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.store.keycheck import unstorable_keys, unstorable_message

log = logging.getLogger(__name__)



EXIT_UNKNOWN_KEY = 2


def _client(args: argparse.Namespace, **options: Any) -> Coalescer:
    """A coalescer on the rules ``--rules`` names (a file, or ``module:attribute``);
    handler modules are imported only for a worker."""
    config = load_rules(args.rules, import_handlers=options.get("worker", True))
    c = Coalescer(config, redis_url=args.redis, **options)
    if is_module_ref(args.rules):  # printed commands name the same rules
        c.hints = dataclasses.replace(c.hints, rules=args.rules)
    return c


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
    verbose = getattr(args, "verbose", False)
    if c.embedded_root is None and not verbose:
        return
    print(f"coalescer {args.command}: {_using(args, c)}", file=sys.stderr, flush=True)
    why = c.embedded_reason
    if c.embedded_root is not None and verbose and why:
        print(f"coalescer {args.command}: chose the folder {_shown_path(c.embedded_root)}: "
              f"{why}", file=sys.stderr, flush=True)


def _refuse_unstorable(keys: list[str], command: str = "touch",
                       undone: str = "touched") -> bool:
    """Print one line for the keys Redis cannot store (bytes that are not UTF-8 in
    argv, a NUL, over the length limit); True if there are any."""
    bad = unstorable_keys(keys)
    if bad:
        print(f"coalescer {command}: {unstorable_message(bad, undone=undone, first='key')}",
              file=sys.stderr)
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
    pairs = [(key, item) for key in args.keys for item in args.items]
    if (_refuse_items(c, pairs) or _refuse_time(args, c.config.limits.max_schedule_ahead)
            or refuse_priority(args.keys, args.priority, c.config)):
        return EXIT_UNKNOWN_KEY
    async with c:
        _say_using(args, c)
        if pairs:
            c.touch_items(pairs, at=args.at, delay=args.delay, priority=args.priority)
        else:
            c.touch_many(args.keys, at=args.at, delay=args.delay, priority=args.priority)
        await c.flush()
    print(_touched(args.json, len(args.keys), len(args.items)) + _when(args))
    return 0


def _refuse_time(args: argparse.Namespace, ahead: float) -> bool:
    """Print why ``--at``/``--delay`` cannot be used; True if it cannot."""
    try:
        schedule_spec(args.keys[0], at=args.at, delay=args.delay, ahead=ahead)
    except InvalidScheduleError as exc:
        flag = "--at" if args.at is not None else "--delay"
        print(f"coalescer touch: {flag} {exc.value!r}: {exc.reason}", file=sys.stderr)
        print("coalescer touch: nothing was touched", file=sys.stderr)
        return True
    return False


def _when(args: argparse.Namespace) -> str:
    """What the text output adds for ``--at``/``--delay`` (the JSON output: nothing)."""
    if args.json or (args.at is None and args.delay is None):
        return ""
    if args.at is not None:
        return f", due at {args.at}"
    return f", due in {args.delay}"


def _refuse_items(c: Coalescer, pairs: list[tuple[str, str]]) -> bool:
    """Print one line for each item that cannot go with its key; True if there are any."""
    bad = c.refused_items(pairs)
    for entry in bad:
        print(f"coalescer touch: item {entry['item']!r} of key {entry['key']!r} cannot be "
              f"touched: {entry['error']}", file=sys.stderr)
    if bad:
        print("coalescer touch: nothing was touched", file=sys.stderr)
    return bool(bad)


def _touched(as_json: bool, keys: int, items: int) -> str:
    if as_json:
        return json.dumps({"touched": keys, "items": items} if items else {"touched": keys})
    with_items = f" with {plural(items, 'item')} each" if items else ""
    return f"touched {plural(keys, 'key')}{with_items}"


async def cmd_status(args: argparse.Namespace) -> int:
    from coalescer.query.status import format_status
    async with _client(args, worker=False, refuse_evicting_policy=False) as c:
        _say_using(args, c)
        status = await c.query.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(namespace_noted(format_status(status, int(time.time() * 1000),
                                             every_shard=args.all_shards, hints=c.hints),
                               c.config.namespace))
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
        outcome = await c.query.retry_dead(None if args.all else args.keys)
        operator_action("retry", keys_target(None if args.all else args.keys), outcome.done,
                        local_user(), sink=c.audit)
    _say_done(args, "requeued", outcome.done, outcome.not_dead)
    return _report_not_dead("retry", outcome.not_dead, "nothing to re-queue")


NOT_PENDING = {
    "idle": "it is idle: nothing to cancel",
    "running": "its refresh is running with nothing queued after it (a running "
               "refresh is not stopped)",
    "dead": "it is dead-lettered (coalescer dead purge deletes it)",
}


async def cmd_cancel(args: argparse.Namespace) -> int:
    if not args.keys or args.rule is not None or args.scheduled_after is not None:
        from coalescer.cli.scheduled_cmds import cancel_scheduled, refuse_arguments
        if refuse_arguments(args):
            return EXIT_UNKNOWN_KEY
        return await cancel_scheduled(args, _client(args, worker=False), _say_using)
    if _refuse_unstorable(args.keys, "cancel", "cancelled"):
        return EXIT_UNKNOWN_KEY
    c = _client(args, worker=False)
    if _unknown_key("cancel", args, c, args.keys):
        print("coalescer cancel: nothing was cancelled", file=sys.stderr)
        return EXIT_UNKNOWN_KEY
    async with c:
        _say_using(args, c)
        outcome = await c.cancel_many(args.keys)
        operator_action("cancel", keys_target(args.keys), outcome.done, local_user(),
                        sink=c.audit)
    if args.json:
        print(json.dumps(outcome.to_json()))
    else:
        print(f"cancelled {plural(outcome.done, 'key')}")
    for key in outcome.not_pending:
        why = NOT_PENDING.get(outcome.states[key], outcome.states[key])
        print(f"coalescer cancel: '{printable(key)}' is not pending; {why}", file=sys.stderr)
    return EXIT_ERROR if outcome.not_pending else 0


async def cmd_pause(args: argparse.Namespace) -> int:
    return await _set_paused(args, paused=True)


async def cmd_resume(args: argparse.Namespace) -> int:
    return await _set_paused(args, paused=False)


async def _set_paused(args: argparse.Namespace, *, paused: bool) -> int:
    c = _client(args, worker=False, refuse_evicting_policy=False)
    if paused and _unknown_rule(args.command, args, c):
        return EXIT_ERROR
    async with c:
        _say_using(args, c)
        action = c.query.pause if paused else c.query.resume
        try:
            changed = await action(args.rule)
        except KeyError:  # not paused, and not in these rules
            _unknown_rule(args.command, args, c)
            return EXIT_ERROR
        operator_action(args.command, f"rule {printable(args.rule)}", int(changed),
                        local_user(), sink=c.audit)
    if args.json:
        print(json.dumps({"rule": args.rule, "paused": paused, "changed": changed}))
    elif paused:
        print(f"paused rule {args.rule} on every node: its keys collect touches and none "
              f"runs until {c.hints.command('resume', args.rule)}"
              + ("" if changed else " (it was paused already)"))
    else:
        print(f"resumed rule {args.rule}: its due keys run now"
              + ("" if changed else " (it was not paused)"))
    return 0


RUN_NOW_NOT_PENDING = {
    "idle": "it is idle: nothing to run (touch it first)",
    "running": "its refresh is running now",
    "dead": "it is dead-lettered (coalescer dead retry re-queues it)",
}


async def cmd_run_now(args: argparse.Namespace) -> int:
    if _refuse_unstorable(args.keys, "run-now", "run"):
        return EXIT_UNKNOWN_KEY
    c = _client(args, worker=False, refuse_evicting_policy=False)
    if _unknown_key("run-now", args, c, args.keys):
        print("coalescer run-now: nothing was run", file=sys.stderr)
        return EXIT_UNKNOWN_KEY
    async with c:
        _say_using(args, c)
        outcome = await c.query.run_now(args.keys)
        operator_action("run-now", keys_target(args.keys), len(outcome.run), local_user(),
                        sink=c.audit)
        paused = set(await c.query.paused())
    if args.json:
        print(json.dumps(outcome.to_json()))
    else:
        print(f"due now: {plural(len(outcome.run), 'key')}")
    for key in outcome.run:
        rule = c.config.rule_for(key).name
        if rule in paused:
            print(f"coalescer run-now: '{printable(key)}' runs once its rule {rule} is "
                  "resumed (it is paused)", file=sys.stderr)
    for key in outcome.not_pending:
        why = RUN_NOW_NOT_PENDING[outcome.states[key]]
        print(f"coalescer run-now: '{printable(key)}' is not pending; {why}", file=sys.stderr)
    return EXIT_ERROR if outcome.not_pending else 0


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
    c = _client(args, worker=False, refuse_evicting_policy=False)
    if _unknown_key("explain", args, c, [args.key]):
        return EXIT_UNKNOWN_KEY
    async with c:
        info = await c.query.explain(args.key)
    print(json.dumps(info, indent=2) if args.json else format_explain(info, hints=c.hints))
    return 0


async def cmd_history(args: argparse.Namespace) -> int:
    from coalescer.query.history import HistoryQuery, format_history
    c = _client(args, worker=False, refuse_evicting_policy=False)
    if _unknown_rule("history", args, c):
        return EXIT_ERROR
    if args.key is not None and _unknown_key("history", args, c, [args.key]):
        return EXIT_UNKNOWN_KEY
    query = HistoryQuery(rule=args.rule, key=args.key, failed=args.failed, limit=args.n)
    async with c:
        found = await c.query.history(query)
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
    page = await c.query.dead_letters(args.keys or None, rule=args.rule, limit=args.limit,
                                      offset=args.offset)
    print(json.dumps(page.to_json(), indent=2) if args.json else format_dead_page(page))
    return _report_not_dead("dead list", page.not_dead, "nothing to show")


async def _dead_act(c: Coalescer, args: argparse.Namespace, what: str) -> int:
    keys = args.keys or None
    if args.action == "retry":
        outcome = await c.query.retry_dead(keys, rule=args.rule)
        operator_action(what, keys_target(keys, rule=args.rule), outcome.done, local_user(),
                        sink=c.audit)
        _say_done(args, "requeued", outcome.done, outcome.not_dead)
        return _report_not_dead(what, outcome.not_dead, "nothing to re-queue")
    outcome = await c.query.purge_dead(keys, rule=args.rule)
    operator_action(what, keys_target(keys, rule=args.rule), outcome.done, local_user(),
                    sink=c.audit)
    _say_done(args, "purged", outcome.done, outcome.not_dead)
    return _report_not_dead(what, outcome.not_dead, "nothing to purge")


async def cmd_run(args: argparse.Namespace) -> int:
    address = http_address(args.http)
    if address is None and http_limits(args):
        raise UsageError(f"{http_limit_argv(args)[0]} limits the HTTP API, which --http off "
                         "turns off: give --http HOST:PORT, or leave the limit out")
    if address is not None and not args.open_http:
        from coalescer.web.api import refuse_open
        from coalescer.web.roles import tokens_from_env
        named = tokens_from_env(os.environ)  # a bad token file: refused before anything runs
        refuse_open(*address, os.environ.get("COALESCER_TOKEN") or (named[0].secret if named
                    else None), allowed="--insecure-no-token")
    if args.processes > 1:
        from coalescer.cli.supervisor import plan_from_args, supervise
        return await supervise(plan_from_args(args, address))
    stopping = Stopping()
    stopping.install(asyncio.get_running_loop())
    node = _client(args, worker=True, node_id=args.node_id, grace=args.grace)
    _refuse_unset_secrets(node.config)
    at_once: asyncio.Task[None] | None = None
    try:
        async with node as c:
            api = await _start_http(c, address, args.http, allow_open=args.open_http,
                                    limits=http_limits(args))
            print(f"coalescer {c.node_id} running, {_using(args, c)}"
                  + (f", HTTP on http://{address[0]}:{api.port}" if api and address else ""),
                  flush=True)
            await stopping.asked.wait()
            print(waiting_line(c.running_keys(), args.grace, stopping.first), flush=True)
            at_once = asyncio.create_task(_after_the_first(c, stopping))
            if api is not None:
                await api.close()
    finally:
        if at_once is not None:
            at_once.cancel()
    return stopping.exit_code


async def _after_the_first(c: Coalescer, stopping: Stopping) -> None:
    """The signals after the first: a SIGINT cancels the running refreshes instead of
    waiting for them; a SIGTERM only says what is still waited for."""
    while await stopping.later.get() != signal.SIGINT:
        print(still_line(c.running_keys()), flush=True)
    print(at_once_line(c.running_keys()), flush=True)
    c.stop_now()


async def _start_http(c: Coalescer, address: tuple[str, int] | None, given: str, *,
                      allow_open: bool, limits: dict[str, Any]) -> Any:
    """The HTTP API on ``address`` (None: off), with the connection ``limits`` given;
    a UsageError naming ``--http`` when it cannot listen there."""
    if address is None:
        return None
    from coalescer.web.api import HttpApi
    from coalescer.web.roles import tokens_from_env
    api = HttpApi(c, host=address[0], port=address[1], token=os.environ.get("COALESCER_TOKEN"),
                  allow_open=allow_open, tokens=tokens_from_env(os.environ), **limits)
    try:
        await api.start()
    except OSError as exc:
        raise UsageError(f"--http {given}: {bind_problem(exc)}; pass another "
                         "--http HOST:PORT, or --http off") from None
    return api


def bind_problem(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the address is in use (another node on this machine?)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "no network interface of this machine has that address"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return f"cannot listen there ({exc.strerror or exc})"


def _refuse_unset_secrets(config: Config) -> None:
    """A worker node does not start while a webhook's secret_env is unset: every
    refresh of that rule would fail and end up dead-lettered."""
    problems = config.unset_secrets(os.environ)
    if problems:
        raise ConfigError.combine(problems)


async def cmd_scheduled(args: argparse.Namespace) -> int:
    from coalescer.cli.scheduled_cmds import list_scheduled
    c = _client(args, worker=False, refuse_evicting_policy=False)
    return await list_scheduled(args, c, _say_using)


async def cmd_keys(args: argparse.Namespace) -> int:
    from coalescer.cli.operator_cmds import keys_command
    return await keys_command(args, _client(args, worker=False), _say_using)


async def cmd_audit(args: argparse.Namespace) -> int:
    from coalescer.cli.operator_cmds import audit_command
    c = _client(args, worker=False, refuse_evicting_policy=False)
    return await audit_command(args, c, _say_using)


async def cmd_demo(args: argparse.Namespace) -> int:
    from coalescer.cli.demo import run_demo
    return await run_demo(args.rules, args.redis)


COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "touch": cmd_touch, "status": cmd_status, "retry": cmd_retry, "run": cmd_run,
    "demo": cmd_demo, "explain": cmd_explain, "history": cmd_history, "dead": cmd_dead,
    "cancel": cmd_cancel, "pause": cmd_pause, "resume": cmd_resume, "run-now": cmd_run_now,
    "scheduled": cmd_scheduled,
}
COMMANDS.update({"keys": cmd_keys, "audit": cmd_audit})


async def cmd_fair(args: argparse.Namespace) -> int:
    from coalescer.cli.fair_cmd import fair_command
    c = _client(args, worker=False, refuse_evicting_policy=False)
    return await fair_command(args, c, _say_using)


COMMANDS["fair"] = cmd_fair


async def cmd_timeline(args: argparse.Namespace) -> int:
    from coalescer.cli.timeline_cmd import timeline_command
    return await timeline_command(args, _client(args, worker=False,
                                                refuse_evicting_policy=False))


COMMANDS["timeline"] = cmd_timeline
