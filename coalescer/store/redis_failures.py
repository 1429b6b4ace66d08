"""What to say when a Redis URL or server is wrong: one line naming the URL (its
password hidden) and what to do, shared by the command line and the library.

The command line prints these lines; the library raises them as coalescer's own
errors (``explained``), chained to redis-py's original (``__cause__``):

- a URL that cannot be read: ``RedisUrlError`` (also a ``ValueError``, as redis-py's was);
- a server that cannot be reached: ``RedisConnectError`` (a ``RedisUnreachableError``;
  ``flush()``'s ``RedisUnreachableError`` becomes one too, with the line);
- a password refused or missing: ``RedisAuthenticationError``.

The last two are also redis-py's ``ConnectionError`` and ``AuthenticationError``, so
code that caught those still does.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.common.redact import redact, redact_url, redact_with
from coalescer.errors import (
    RedisAuthenticationError,
    RedisConnectError,
    RedisUnreachableError,
    RedisUrlError,
)
from coalescer.store.sentinel import is_sentinel_url, parse_sentinel_url

SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://")
EMBEDDED = "the embedded server"


def shown(value: str) -> str:
    """``value`` with its password hidden, even when it lacks a scheme."""
    if "://" in value:
        return redact_url(value)
    return redact_url("redis://" + value).removeprefix("redis://")


def _suggestion(value: str) -> str:
    if "://" in value:
        return ("write redis://HOST:PORT/0 (rediss:// for TLS, unix:///PATH for a socket, "
                "redis+sentinel://HOST:PORT/SERVICE for Redis Sentinel)")
    host = value if ":" in value.rpartition("@")[2] else f"{value}:6379"
    return f"write redis://{shown(host)}{'' if '/' in value else '/0'}"


def url_problem(value: str) -> str | None:
    """Why ``value`` cannot work as a Redis URL and what to write instead (its password
    hidden); None for a usable one."""
    if not value.startswith(SCHEMES):
        return f"{shown(value)!r} is not a Redis URL; {_suggestion(value)}"
    if is_sentinel_url(value):
        try:
            parse_sentinel_url(value)
        except ValueError as exc:
            return f"{shown(value)!r} is not a usable Redis Sentinel URL: {exc}"
        return None
    try:
        parse_url(value)
    except ValueError as exc:
        return (f"{shown(value)!r} is not a usable Redis URL: {_parse_reason(value, exc)}; "
                "write redis://HOST:PORT/0")
    return None


def _parse_reason(value: str, exc: ValueError) -> str:
    """Why redis-py refused ``value``; its words are left out when the URL holds a
    password, since they may quote a piece of it (a password with an unencoded '/' is
    read as a port)."""
    if "@" not in value:
        return str(exc)
    return ("it cannot be read; a '/', '?', '#', '@' or space in the password must be "
            "percent-encoded (%2F, %3F, %23, %40, %20)")


def check_url(value: str, where: str) -> None:
    """RedisUrlError (``where: problem``) for a URL that cannot work, raised from
    redis-py's ValueError unless the URL holds a password (its words may quote it)."""
    problem = url_problem(value)
    if problem is not None:
        raise RedisUrlError(problem, where=where) from _parse_error(value)


def _parse_error(value: str) -> ValueError | None:
    if "@" in value or "password" in value.lower():
        return None
    try:
        parse_sentinel_url(value) if is_sentinel_url(value) else parse_url(value)
    except ValueError as exc:
        return exc
    return None


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is a Redis server listening there?)"
    if isinstance(cause, socket.gaierror):
        return f"host not found ({cause.strerror})"
    if isinstance(exc, RedisTimeoutError) or isinstance(cause, TimeoutError):
        return "timed out"
    return redact(str(exc))


def original(exc: RedisError) -> RedisError:
    """redis-py's error that one of ours was raised from (``exc`` itself otherwise)."""
    if not isinstance(exc, (RedisConnectError, RedisAuthenticationError)):
        return exc
    if isinstance(exc.__cause__, RedisError):
        return exc.__cause__
    return _connection_error(exc) or exc  # flush(): through its RedisUnreachableError


def failure(url: str | None, exc: RedisError, origin: str = "") -> str:
    """One line: which server failed (``url``, None for the embedded server) and how,
    its password hidden; ``origin`` (e.g. "--redis") says where the URL came from."""
    line = _failure(url, original(exc), origin)
    if url is None or line.endswith(PASSWORD_HINT):  # nothing of the server's: no password
        return line
    return redact_with(line, url)


PASSWORD_HINT = "redis://:PASSWORD@HOST:PORT/0"  # the form of a URL with a password


def _failure(url: str | None, exc: RedisError, origin: str) -> str:
    shown_url = redact_url(url) if url else EMBEDDED
    if isinstance(exc, AuthenticationError):
        reason = redact(str(exc))
        if url is None or shown_url == url:
            reason = f"the server requires a password; give it in the URL: {PASSWORD_HINT}"
        else:
            reason = f"the server refused the password ({reason})"
        return " ".join(f"{shown_url}: {reason}".split())
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        where = f" (from {origin})" if origin else ""
        return " ".join(f"could not connect to {shown_url}{where}: {_reason(exc)}".split())
    return " ".join(f"{shown_url}: {redact(str(exc))}".split())


@contextlib.asynccontextmanager
async def explained(url: str | None, origin: str = "") -> AsyncIterator[None]:
    """Raise redis-py's connection and password errors met in the block as coalescer's
    own (see the module's docstring), saying what ``failure`` says; others go on as is."""
    try:
        yield
    except (RedisConnectError, RedisAuthenticationError):
        raise
    except AuthenticationError as exc:
        raise RedisAuthenticationError(failure(url, exc, origin)) from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise RedisConnectError(failure(url, exc, origin)) from exc
    except RedisUnreachableError as exc:  # flush(): the write's error is its cause
        found = _connection_error(exc)
        if found is None:
            raise
        raise RedisConnectError(failure(url, found, origin)) from exc


def _connection_error(exc: BaseException) -> RedisError | None:
    """The first of redis-py's connection errors among ``exc``'s causes."""
    seen = exc.__cause__
    for _ in range(8):  # a short chain: the flusher's wrapper, redis-py's error
        if seen is None or isinstance(seen, RedisConnectionError | RedisTimeoutError):
            return seen
        seen = seen.__cause__ or getattr(seen, "cause", None)
    return None
