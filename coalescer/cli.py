"""The `coalescer` command line (SPEC §4)."""

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
from typing import Any

from redis.exceptions import RedisError

from .coalescer import Coalescer
from .errors import CoalescerError, ConfigError, shown_key
from .keycheck import key_problem
from .rules import Config

log = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_UNKNOWN_KEY = 2
DEFAULT_HTTP = "127.0.0.1:8470"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rules", default="./rules.yaml", metavar="PATH",
                        help="rules file (default ./rules.yaml)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default $COALESCER_REDIS_URL, else the embedded server)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coalescer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a node: absorb, elect, poll, refresh")
    _common(run)
    run.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                     help=f"HTTP API address (default {DEFAULT_HTTP}; 'off' disables it)")
    run.add_argument("--node-id", default=None, metavar="ID", help="node id (default HOST:PID)")
    run.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                     help="how long SIGTERM waits for running refreshes (default 30)")
    touch = sub.add_parser("touch", help="touch keys; exits once Redis holds them")
    _common(touch)
    touch.add_argument("keys", nargs="+", metavar="KEY")
    check = sub.add_parser("check", help="validate a rules file")
    check.add_argument("path", nargs="?", default=None, metavar="PATH")
    check.add_argument("--rules", default="./rules.yaml", metavar="PATH", dest="rules")
    check.add_argument("--redis", default=None, metavar="URL", help="(unused)")
    status = sub.add_parser("status", help="leaders, pending, in flight, dead letters")
    _common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    retry = sub.add_parser("retry", help="re-queue dead-lettered keys")
    _common(retry)
    retry.add_argument("keys", nargs="*", metavar="KEY")
    retry.add_argument("--all", action="store_true", help="re-queue every dead key")
    demo = sub.add_parser("demo", help="a self-contained showcase on the embedded server")
    _common(demo)
    return p


def _client(args: argparse.Namespace, **options: Any) -> Coalescer:
    return Coalescer.from_yaml(args.rules, redis_url=args.redis, **options)


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
        for key in args.keys:
            c.touch(key)
        await c.flush()
    print(f"touched {len(args.keys)} key(s)")
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from .status import format_status
    async with _client(args, worker=False) as c:
        status = await c.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status, int(time.time() * 1000)))
    return 0


async def cmd_retry(args: argparse.Namespace) -> int:
    if not args.keys and not args.all:
        print("coalescer retry: name KEYs or pass --all", file=sys.stderr)
        return EXIT_ERROR
    c = _client(args, worker=False)
    unknown = c.unknown_keys(args.keys)
    if unknown:
        print(f"coalescer retry: no rule matches {', '.join(map(repr, unknown))}",
              file=sys.stderr)
        return EXIT_UNKNOWN_KEY
    async with c:
        n = await c.retry_dead(None if args.all else args.keys)
    print(f"re-queued {n} dead-lettered key(s)")
    return 0


def _http_address(value: str) -> tuple[str, int] | None:
    if value == "off":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--http wants HOST:PORT or 'off', not {value!r}", file="--http")
    return host or "127.0.0.1", int(port)


async def cmd_run(args: argparse.Namespace) -> int:
    address = _http_address(args.http)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with _client(args, worker=True, node_id=args.node_id, grace=args.grace) as c:
        api = await _start_http(c, address)
        print(f"coalescer {c.node_id} running on {c.redis_url}"
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
    from .http_api import HttpApi
    api = HttpApi(c, host=address[0], port=address[1], token=os.environ.get("COALESCER_TOKEN"))
    await api.start()
    return api


def cmd_check(args: argparse.Namespace) -> int:
    config = Config.from_yaml(args.path or args.rules)
    print(f"{config.source}: OK")
    print(config.describe())
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return await run_demo(args.rules, args.redis)


COMMANDS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "touch": cmd_touch, "status": cmd_status, "retry": cmd_retry, "run": cmd_run,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "check":
            return cmd_check(args)
        return asyncio.run(COMMANDS[args.command](args))
    except ConfigError as exc:
        print(f"coalescer {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (RedisError, OSError, CoalescerError) as exc:
        print(f"coalescer {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
