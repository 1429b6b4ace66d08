"""`coalescer run --processes N`: N node processes on one machine, supervised: node ids,
ports, signals forwarded, restarts and when the group gives up are docs/cli.md's
"Every core: run --processes N". The children run in a process group of their own, so
a Ctrl-C in the terminal reaches them once, through the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from coalescer.cli.parser import http_limit_argv
from coalescer.cli.stopping import STOPPED_AT_ONCE, again_hint
from coalescer.config.rules_source import load_rules
from coalescer.errors import ConfigError

log = logging.getLogger(__name__)

BACKOFF_FIRST = 0.5  # seconds before the first restart of a crashed child
BACKOFF_MAX = 8.0
QUICK_CRASH = 10.0  # a child that dies sooner than this after its start crashed "quickly"
GIVE_UP_AFTER = 5  # quick crashes in a row of one child stop the group
PR_SET_PDEATHSIG = 1
MAX_PORT = 65535
PLAIN_COMMAND = (sys.executable, "-m", "coalescer.cli")


@dataclass(frozen=True, kw_only=True)
class ChildPlan:
    """What every child is started with; ``http`` is (host, port) or None for off."""

    processes: int
    rules: str
    redis: str | None
    node_id: str | None
    http: tuple[str, int] | None
    grace: float
    verbose: bool
    quiet: bool = False  # -q: no line per refresh
    open_http: bool = False  # --insecure-no-token
    http_limits: tuple[str, ...] = ()  # --http-max-connections N ... as given
    # what runs a child before "run ...": the plain command, or Django's manage.py
    command: tuple[str, ...] = PLAIN_COMMAND

    def argv(self, k: int) -> list[str]:
        """The command line of child ``k``."""
        cmd = [*self.command, "run", "--rules", self.rules,
               "--grace", repr(self.grace), "--http", self._http(k)]
        if self.redis is not None:
            cmd += ["--redis", self.redis]
        if self.node_id is not None:
            cmd += ["--node-id", f"{self.node_id}-{k}"]
        if self.verbose:
            cmd.append("-v")
        if self.quiet:
            cmd.append("-q")
        if self.open_http:
            cmd.append("--insecure-no-token")
        return cmd + list(self.http_limits)

    def _http(self, k: int) -> str:
        if self.http is None:
            return "off"
        host, port = self.http
        return f"{host}:{port + k if port else 0}"


def plan_from_args(args: Any, http: tuple[str, int] | None) -> ChildPlan:
    """The children of ``coalescer run --processes N``, each given the same ``--rules``;
    the rules (a file, or ``module:attribute``) are checked once here."""
    load_rules(args.rules)
    if http is not None and http[1] and http[1] + args.processes - 1 > MAX_PORT:
        raise ConfigError(f"--http port {http[1]} + {args.processes - 1} children is past "
                          f"{MAX_PORT}", file="--http")
    return ChildPlan(processes=args.processes, rules=args.rules, redis=args.redis,
                     node_id=args.node_id, http=http, grace=args.grace,
                     verbose=bool(args.verbose), quiet=bool(getattr(args, "quiet", False)),
                     open_http=bool(args.open_http),
                     http_limits=tuple(http_limit_argv(args)),
                     command=tuple(getattr(args, "child_command", ())) or PLAIN_COMMAND)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (Linux; else nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class Supervisor:
    """Starts, restarts and stops the children of one ``run --processes N``."""

    def __init__(self, plan: ChildPlan) -> None:
        self.plan = plan
        self.children: dict[int, asyncio.subprocess.Process] = {}
        self._stop = asyncio.Event()
        self._signal = signal.SIGTERM
        self._again = False  # a SIGINT after the stop: the children stop at once
        self._gave_up = False
        self._exit_codes: dict[int, int] = {}

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        log.info("supervisor %d: starting %d node processes", os.getpid(), self.plan.processes)
        slots = [asyncio.create_task(self._slot(k)) for k in range(self.plan.processes)]
        await self._stop.wait()
        self._forward()
        await asyncio.gather(*slots)
        if self._again:
            return STOPPED_AT_ONCE
        bad = {k: rc for k, rc in self._exit_codes.items() if rc != 0}
        if bad:
            log.error("supervisor: children exited non-zero after the stop: %s", bad)
        return 1 if self._gave_up or bad else 0

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._stop.is_set():
            log.info("supervisor: %s received: stopping the children (%s to stop them at "
                     "once)", sig.name, again_hint(sig))
        elif sig == signal.SIGINT and not self._again:
            log.info("supervisor: SIGINT received again: the children stop at once")
            self._again = True
        self.stop(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the group: every child gets ``sig`` (again, on a second signal)."""
        if self._stop.is_set():
            self._forward(sig)
            return
        self._signal = sig
        self._stop.set()

    def _forward(self, sig: signal.Signals | None = None) -> None:
        for proc in self.children.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig or self._signal)

    async def _slot(self, k: int) -> None:
        """Child ``k``: started, and restarted after each crash until the stop."""
        crashes = 0
        while not self._stop.is_set():
            started = time.monotonic()
            proc = await self._spawn(k)
            rc = await proc.wait()
            if self._stop.is_set():
                self._exit_codes[k] = self._stopped(k, proc.pid, rc)
                return
            crashes = crashes + 1 if time.monotonic() - started < QUICK_CRASH else 1
            if crashes >= GIVE_UP_AFTER:
                log.error("supervisor: child %d keeps crashing (%d times in a row within %gs "
                          "of its start, last %s): stopping", k, crashes, QUICK_CRASH, _how(rc))
                self._gave_up = True
                self.stop()
                return
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (crashes - 1))
            log.warning("supervisor: child %d (pid %d) %s; restarting it in %gs",
                        k, proc.pid, _how(rc), delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    def _stopped(self, k: int, pid: int, rc: int) -> int:
        """A child's exit code after the stop. One killed by the signal it was sent
        had not yet set its handlers (they are set before its node starts): it had
        taken no work, so it stopped cleanly."""
        if rc == -int(self._signal):
            log.info("supervisor: child %d (pid %d) was stopped while it was starting", k, pid)
            return 0
        log.info("supervisor: child %d (pid %d) exited %d", k, pid, rc)
        return rc

    async def _spawn(self, k: int) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *self.plan.argv(k), stdin=asyncio.subprocess.DEVNULL, preexec_fn=_die_with_parent,
            process_group=0)  # a terminal's Ctrl-C reaches them through the supervisor
        self.children[k] = proc
        name = (f"{self.plan.node_id}-{k}" if self.plan.node_id
                else f"{socket.gethostname()}:{proc.pid}")
        log.info("supervisor: child %d started, pid %d, node id %s", k, proc.pid, name)
        if self._stop.is_set():  # the stop came while it was starting
            proc.send_signal(self._signal)
        return proc


def _how(rc: int) -> str:
    return f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"


async def supervise(plan: ChildPlan) -> int:
    """Run the children of ``plan`` until SIGTERM or SIGINT; the exit status of the group."""
    return await Supervisor(plan).run()
