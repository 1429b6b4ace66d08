"""Redis Sentinel URLs: ``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``.

The hosts are sentinels; SERVICE is the name of the master they monitor (``sentinel
monitor SERVICE ...``). The password (and user) are those of the Redis servers, not of
the sentinels. A client built here asks the sentinels for the master each time one of
its connections connects, so it follows a failover: a connection that fails (the
master died) or meets READONLY (the old master came back as a replica) is dropped,
and the next attempt connects to the master the sentinels name now. The pool is
bounded and blocking, like a single server's (see connection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SCHEME = "redis+sentinel://"
DEFAULT_PORT = 26379
MAX_PORT = 65535
_SENTINEL_OPTIONS = ("socket_connect_timeout", "socket_timeout")
FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"


@dataclass(frozen=True, kw_only=True, slots=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL (no password is ever shown by its repr)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"SentinelUrl({hosts}/{self.service}/{self.db})"


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SCHEME)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of ``url``; ValueError saying what is wrong (never quoting the password)."""
    if not is_sentinel_url(url):
        raise ValueError(f"a Sentinel URL starts with {SCHEME}")
    rest = url[len(SCHEME):].split("?", 1)[0].split("#", 1)[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    service, db = _path(path)
    return SentinelUrl(sentinels=tuple(_host(h) for h in hosts.split(",")), service=service,
                       db=db, username=username, password=password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _host(part: str) -> tuple[str, int]:
    host, colon, port = part.strip().rpartition(":")
    if not colon:
        host, port = port, str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host:
        raise ValueError(f"a sentinel address is missing its host (write {FORM})")
    if not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise ValueError(f"sentinel port {port!r} is not a port number (1 to {MAX_PORT})")
    return host, int(port)


def _path(path: str) -> tuple[str, int]:
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError(f"the URL names no service: write {FORM}")
    if db and not db.isdigit():
        raise ValueError(f"database {db!r} is not a number")
    return unquote(service), int(db or 0)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A sentinel-managed pool that waits for a free connection instead of failing."""


class SentinelRedis(Redis):
    """A client on a sentinel-monitored master; closing it closes its sentinel clients too."""

    def __init__(self, *, connection_pool: SentinelConnectionPool, manager: Sentinel) -> None:
        super().__init__(connection_pool=connection_pool)
        self.auto_close_connection_pool = True  # the pool is this client's alone
        self.manager = manager

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.manager.aclose()


def sentinel_client(url: str, *, max_connections: int, timeout: float,
                    options: dict[str, Any]) -> SentinelRedis:
    """A client on the master ``url`` names, its pool of ``max_connections`` waiting up to
    ``timeout`` for a free one; ``options`` go to every connection (and the sentinels
    get its timeouts)."""
    parsed = parse_sentinel_url(url)
    timeouts: dict[str, Any] = {name: options[name] for name in _SENTINEL_OPTIONS
                                if name in options}
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=timeouts)
    pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        parsed.service, sentinel, max_connections=max_connections, timeout=timeout,
        db=parsed.db, username=parsed.username, password=parsed.password, **options)
    return SentinelRedis(connection_pool=pool, manager=sentinel)
