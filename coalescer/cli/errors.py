"""What the command line says when an option or the Redis server is wrong: one line
that names the value at fault (its password hidden) and what to write instead."""

from __future__ import annotations

import os
import socket

from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.common.redact import redact, redact_url
from coalescer.errors import CoalescerError
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.store.sentinel import is_sentinel_url, parse_sentinel_url

SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://")
MAX_PORT = 65535


class UsageError(CoalescerError):
    """A command-line value that cannot be used; its message is the whole line."""


def redis_source(explicit: str | None) -> tuple[str, str] | None:
    """(URL, where it came from: "--redis" or "$COALESCER_REDIS_URL"); None for the
    embedded server."""
    if explicit:
        return explicit, "--redis"
    from_env = os.environ.get(ENV_REDIS_URL)
    return (from_env, "$" + ENV_REDIS_URL) if from_env else None


def _shown(value: str) -> str:
    """``value`` with its password hidden, even when it lacks a scheme."""
    if "://" in value:
        return redact_url(value)
    return redact_url("redis://" + value).removeprefix("redis://")


def _suggestion(value: str) -> str:
    if "://" in value:
        return ("write redis://HOST:PORT/0 (rediss:// for TLS, unix:///PATH for a socket, "
                "redis+sentinel://HOST:PORT/SERVICE for Redis Sentinel)")
    host = value if ":" in value.rpartition("@")[2] else f"{value}:6379"
    return f"write redis://{_shown(host)}{'' if '/' in value else '/0'}"


def check_redis_url(explicit: str | None) -> None:
    """Raise UsageError, before anything connects, for a Redis URL that cannot work."""
    source = redis_source(explicit)
    if source is None:
        return
    value, where = source
    if not value.startswith(SCHEMES):
        raise UsageError(f"{where}: {_shown(value)!r} is not a Redis URL; {_suggestion(value)}")
    if is_sentinel_url(value):
        try:
            parse_sentinel_url(value)
        except ValueError as exc:
            raise UsageError(f"{where}: {_shown(value)!r} is not a usable Redis Sentinel "
                             f"URL: {exc}") from None
        return
    try:
        parse_url(value)
    except ValueError as exc:
        raise UsageError(f"{where}: {_shown(value)!r} is not a usable Redis URL: "
                         f"{_parse_reason(value, exc)}; write redis://HOST:PORT/0") from None


def _parse_reason(value: str, exc: ValueError) -> str:
    """Why redis-py refused ``value``; its words are left out when the URL holds a
    password, since they may quote a piece of it (a password with an unencoded '/' is
    read as a port)."""
    if "@" not in value:
        return str(exc)
    return ("it cannot be read; a '/', '?', '#', '@' or space in the password must be "
            "percent-encoded (%2F, %3F, %23, %40, %20)")


def http_address(value: str) -> tuple[str, int] | None:
    """``--http HOST:PORT`` or ``off``; a bad value is a UsageError naming it."""
    if value == "off":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > MAX_PORT:
        raise UsageError("--http wants HOST:PORT or 'off' "
                         f"(PORT 0 to {MAX_PORT}), not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is a Redis server listening there?)"
    if isinstance(cause, socket.gaierror):
        return f"host not found ({cause.strerror})"
    if isinstance(exc, RedisTimeoutError) or isinstance(cause, TimeoutError):
        return "timed out"
    return redact(str(exc))


def redis_failure(explicit: str | None, exc: RedisError) -> str:
    """One line: which server failed and how (its password hidden)."""
    source = redis_source(explicit)
    url = redact_url(source[0]) if source else "the embedded server"
    origin = f" (from {source[1]})" if source else ""
    if isinstance(exc, AuthenticationError):
        reason = redact(str(exc))
        if source is None or url == source[0]:
            reason = ("the server requires a password; give it in the URL: "
                      "redis://:PASSWORD@HOST:PORT/0")
        else:
            reason = f"the server refused the password ({reason})"
        return " ".join(f"{url}: {reason}".split())
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return " ".join(f"could not connect to {url}{origin}: {_reason(exc)}".split())
    return " ".join(f"{url}: {redact(str(exc))}".split())
