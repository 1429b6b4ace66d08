"""How `coalescer run` stops: the first SIGINT or SIGTERM drains, a SIGINT after it
(a second Ctrl-C) stops at once.

The signal handlers only set events. The node's coroutine then says, in one line,
what it waits for; a SIGINT after the first signal cancels the running refreshes
(their keys run again once their claim lease expires, as after a crash) and the
command exits 130. A repeated SIGTERM changes nothing: process managers send it more
than once (systemd signals every process of a unit) and end what outlives its grace
with SIGKILL.
"""

from __future__ import annotations

import asyncio
import signal

from coalescer.common.plural import plural
from coalescer.common.printable import printable
from coalescer.config.durations import format_duration

SHOWN_KEYS = 5  # keys named in a stopping line, at most
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOPPED_AT_ONCE = 128 + signal.SIGINT  # the exit status after a stop at once: 130


class Stopping:
    """The stop signals a process received: ``asked`` is set by the first; each later
    one is queued in ``later``, and ``at_once`` is set by a SIGINT among them."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.at_once = False
        self.later: asyncio.Queue[signal.Signals] = asyncio.Queue()
        self.first: signal.Signals | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.received, sig)

    def received(self, sig: signal.Signals) -> None:
        if self.first is None:
            self.first = sig
            self.asked.set()
            return
        self.at_once = self.at_once or sig == signal.SIGINT
        self.later.put_nowait(sig)

    @property
    def exit_code(self) -> int:
        """0 after a drain; 130 after a stop at once."""
        return STOPPED_AT_ONCE if self.at_once else 0


def again_hint(first: signal.Signals | None) -> str:
    """How to stop at once after ``first``: another Ctrl-C, or a SIGINT after a SIGTERM."""
    return "press Ctrl-C again" if first in (signal.SIGINT, None) else "send SIGINT"


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


def still_line(keys: list[str]) -> str:
    """What a repeated SIGTERM does: nothing but say so."""
    if not keys:
        return "stopping: SIGTERM again; no refresh is running"
    running = plural(len(keys), "running refresh", "running refreshes")
    return (f"stopping: SIGTERM again; still waiting for {running} {named(keys)}; send "
            "SIGINT to stop at once")


def at_once_line(keys: list[str]) -> str:
    """What the second signal does."""
    if not keys:
        return "stopping at once"
    running = plural(len(keys), "running refresh", "running refreshes")
    return (f"stopping at once: cancelling {running} {named(keys)}; they run again once "
            "their claim lease expires")
