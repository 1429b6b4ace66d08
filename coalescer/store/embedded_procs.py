"""The embedded server's processes as /proc tells of them: alive, started when, listening
on which Unix socket; and stopping one (only ever a process known to be the one a record
names)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from coalescer.errors import CoalescerError

_UNIX_LISTENING = "01"  # a listening Unix socket's state in /proc/net/unix


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None where unavailable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def start_time(pid: int) -> str:
    """The process's start time in clock ticks ("" where /proc is unavailable)."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else ""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running process (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return not (fields and fields[0] in ("Z", "X"))


def is_valkey(pid: int) -> bool:
    """Best effort: does ``pid`` look like a valkey-server (Linux only)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"valkey-server" in cmdline or b"redis-server" in cmdline


def _socket_inodes(pid: int) -> set[str] | None:
    """The inodes of the sockets ``pid`` holds open; None where /proc cannot tell."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def listening(pid: int, path: Path) -> bool | None:
    """Whether process ``pid`` listens on the Unix socket ``path`` (None where /proc
    cannot tell)."""
    inodes = _socket_inodes(pid)
    if inodes is None:
        return None
    try:
        rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        # Num RefCount Protocol Flags Type St Inode Path (the path may hold spaces)
        cols = row.split(maxsplit=7)
        if (len(cols) > 7 and cols[5] == _UNIX_LISTENING and cols[6] in inodes
                and cols[7] == str(path)):
            return True
    return False


def serves(pid: int, path: Path) -> bool:
    """True if ``pid`` is alive and, where /proc tells, listens on the socket ``path``:
    only then may the password be sent there."""
    return pid_alive(pid) and listening(pid, path) is not False


def is_recorded_process(pid: int, started: str, socket: Path) -> bool:
    """True only if ``pid`` is still the very process a record was written for: same
    start time ``started`` (a reused pid has another), or, for a record without one, a
    process that listens on the folder's ``socket``. Only such a process may be
    signalled."""
    if not pid_alive(pid):
        return False
    if started:
        return start_time(pid) == started
    return listening(pid, socket) is True


def wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def terminate(pid: int, timeout: float) -> None:
    """SIGTERM, then SIGKILL, a server that SHUTDOWN did not stop."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if wait_exit(pid, timeout):
            return
    raise CoalescerError(f"embedded valkey-server pid {pid} does not exit")
