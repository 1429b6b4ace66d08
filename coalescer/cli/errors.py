"""What the command line says when an option or the Redis server is wrong: one line
that names the value at fault (its password hidden) and what to write instead."""

from __future__ import annotations

import os

from redis.exceptions import RedisError

from coalescer.errors import CoalescerError
from coalescer.store.embedded import ENV_REDIS_URL
from coalescer.store.redis_failures import failure, url_problem

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


def check_redis_url(explicit: str | None) -> None:
    """Raise UsageError, before anything connects, for a Redis URL that cannot work."""
    source = redis_source(explicit)
    if source is None:
        return
    value, where = source
    problem = url_problem(value)
    if problem is not None:
        raise UsageError(f"{where}: {problem}")


def http_address(value: str) -> tuple[str, int] | None:
    """``--http HOST:PORT`` or ``off``; a bad value is a UsageError naming it."""
    if value == "off":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > MAX_PORT:
        raise UsageError("--http wants HOST:PORT or 'off' "
                         f"(PORT 0 to {MAX_PORT}), not {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def redis_failure(explicit: str | None, exc: RedisError) -> str:
    """One line: which server failed and how (its password hidden)."""
    source = redis_source(explicit)
    if source is None:
        return failure(None, exc)
    return failure(source[0], exc, source[1])
