"""The HTTP API's listening sockets, served by an accept loop of their own.

asyncio's accept loop answers accept() failing for want of file descriptors (EMFILE)
by logging a traceback, and keeps trying the rest of its batch, each failure logging
again and scheduling one more retry, so a flood that reaches the file limit writes
hundreds of tracebacks a second, and more at shutdown (each pending retry fails on the
closed socket). Here a failed accept is handed to a callback (the guard counts it for
its summary line) and accepting pauses briefly, the time for connections to close.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

ACCEPT_PAUSE = 0.1  # seconds without accepting after accept() failed

ProtocolFactory = Callable[[], asyncio.Protocol]


async def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening, non-blocking sockets on every address ``host`` resolves to; an OSError
    (its errno kept, e.g. EADDRINUSE) when one cannot be bound."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # unique, in order
            bound.append(_listening(family, kind, proto, address, backlog))
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def _listening(family: int, kind: int, proto: int, address: Any,
               backlog: int) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # elsewhere it would let another process take the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Listener(asyncio.AbstractServer):
    """Accepts on ``sockets`` and connects each accepted socket to a protocol of
    ``factory``; ``failed`` gets every error accept() meets (accepting goes on)."""

    def __init__(self, sockets: Sequence[socket.socket], factory: ProtocolFactory,
                 failed: Callable[[OSError], None]) -> None:
        self.sockets = tuple(sockets)
        self._factory = factory
        self._failed = failed
        self._loop = asyncio.get_running_loop()
        self._connecting: set[asyncio.Task[None]] = set()
        self._accepting = [self._loop.create_task(self._accept(sock)) for sock in self.sockets]

    async def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(sock)
            except ConnectionAbortedError:  # the client left before it was accepted
                continue
            except OSError as exc:
                self._failed(exc)
                await asyncio.sleep(ACCEPT_PAUSE)
                continue
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
            await asyncio.sleep(0)  # one a turn: a full backlog must not starve the others

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:  # reset before its transport was made: nothing to serve
            conn.close()

    def close(self) -> None:
        for task in self._accepting:
            task.cancel()
        for sock in self.sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
                sock.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return any(not task.done() for task in self._accepting)

    async def start_serving(self) -> None:
        """Serving starts when made."""

    async def serve_forever(self) -> None:
        await asyncio.gather(*self._accepting)

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._accepting, return_exceptions=True)
