"""How `coalescer run` stops: the first SIGINT or SIGTERM drains, a second stops at once.

The signal handlers only set events. The node's coroutine then says, in one line,
what it waits for; a second signal cancels the running refreshes (their keys run
again once their claim lease expires, as after a crash) and the command exits with
128 + that signal's number (130 for Ctrl-C).
"""

from __future__ import annotations

import asyncio
import signal

from coalescer.common.plural import plural
from coalescer.common.printable import printable
from coalescer.config.durations import format_duration

SHOWN_KEYS = 5  # keys named in a stopping line, at most
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopping:
    """The stop signals a process received: ``asked`` is set by the first, ``again``
    by the second."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.again = asyncio.Event()
        self.first: signal.Signals | None = None
        self.second: signal.Signals | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.received, sig)

    def received(self, sig: signal.Signals) -> None:
        if self.first is None:
            self.first = sig
            self.asked.set()
        elif self.second is None:
            self.second = sig
            self.again.set()

    @property
    def exit_code(self) -> int:
        """0 after a drain; 128 + the second signal's number after a stop at once."""
        return 0 if self.second is None else 128 + int(self.second)


def again_hint(sig: signal.Signals | None) -> str:
    return "press Ctrl-C again" if sig in (signal.SIGINT, None) else f"send {sig.name} again"


def named(keys: list[str]) -> str:
    """"(key a, b and 3 more)"-style: the first keys, escaped."""
    shown = ", ".join(printable(key) for key in keys[:SHOWN_KEYS])
    more = len(keys) - SHOWN_KEYS
    return f"({'key' if len(keys) == 1 else 'keys'} {shown}" + (
        f" and {more} more)" if more > 0 else ")")


def waiting_line(keys: list[str], grace: float, sig: signal.Signals | None) -> str:
    """What the first signal waits for, e.g. "stopping: waiting up to 30s for 2 running
    refreshes (keys a, b); press Ctrl-C again to stop at once"."""
    if not keys:
        return "stopping: no refresh is running"
    running = plural(len(keys), "running refresh", "running refreshes")
    return (f"stopping: waiting up to {format_duration(grace)} for {running} {named(keys)}; "
            f"{again_hint(sig)} to stop at once")


def at_once_line(keys: list[str]) -> str:
    """What the second signal does."""
    if not keys:
        return "stopping at once"
    running = plural(len(keys), "running refresh", "running refreshes")
    return (f"stopping at once: cancelling {running} {named(keys)}; they run again once "
            "their claim lease expires")
