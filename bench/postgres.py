"""A real PostgreSQL server for the tests and the benchmarks, from the Debian binaries.

``initdb`` and ``pg_ctl`` (``/usr/lib/postgresql/NN/bin``, the newest found, or
``COALESCER_PG_BIN``) refuse to run as root: as root, the server runs as the user
``nobody``, in a folder of its own under the system's temp folder, which that user
owns. It listens on 127.0.0.1 only, on a free port, trusting local connections.
``find_binaries()`` says why there is no server where the binaries are missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .valkey import HOST, free_port

USER = "postgres"  # the database superuser initdb creates
RUN_AS = "nobody"  # the system user that runs the server when we are root


def find_binaries() -> tuple[Path | None, str]:
    """The folder holding initdb and pg_ctl, or None and why not."""
    given = os.environ.get("COALESCER_PG_BIN")
    candidates = [Path(given)] if given else sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True)
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder, ""
    if given:
        return None, f"no initdb and pg_ctl in $COALESCER_PG_BIN ({given})"
    return None, ("PostgreSQL binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin"
                  " (apt-get install postgresql, or set COALESCER_PG_BIN)")


def _demote() -> Callable[[], None] | None:
    """As root, the function that makes a child process the user RUN_AS."""
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam(RUN_AS)

    def demote() -> None:
        os.setgid(entry.pw_gid)
        os.setgroups([])
        os.setuid(entry.pw_uid)
    return demote


class PostgresServer:
    """One PostgreSQL server: ``start()``, ``url``, ``kill()``, ``stop()``."""

    def __init__(self, *, durable: bool = False) -> None:
        folder, why = find_binaries()
        if folder is None:
            raise FileNotFoundError(why)
        self.bin = folder
        self.port = free_port()
        self.durable = durable  # fsync on: what a production server does
        self.root = Path(tempfile.mkdtemp(prefix="coalescer-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._demote = _demote()
        if self._demote is not None:
            entry = pwd.getpwnam(RUN_AS)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    @property
    def url(self) -> str:
        """A SQLAlchemy (and libpq) URL of the ``postgres`` database."""
        return f"postgresql://{USER}@{HOST}:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run([str(self.bin / args[0]), *args[1:]], preexec_fn=self._demote,
                              capture_output=True, text=True, timeout=60, check=False,
                              cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr.strip()}"
                               f"\n{self.log_tail()}")

    def start(self) -> PostgresServer:
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust",
                      "--no-sync", "-E", "UTF8")
        options = (f"-c listen_addresses={HOST} -c port={self.port} "
                   f"-c unix_socket_directories={self.root} -c max_connections=200")
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "-t", "60", "start")
        return self

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """Stop fast (connections are closed, nothing committed is lost)."""
        if self.pid() is not None:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        """Stop (immediately) and remove its folder."""
        if self.pid() is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
