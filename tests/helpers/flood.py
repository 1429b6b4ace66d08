"""A connection flood from a process of its own (an attacker is not in the prober's
event loop): SOCKETS connections to 127.0.0.1:PORT that send half a request header
and stall, each opened again as soon as the server closes it, for SECONDS at most.

    python -m tests.helpers.flood PORT SOCKETS SECONDS

Prints the number of connections opened when it ends (SIGTERM ends it early).
"""

from __future__ import annotations

import asyncio
import signal
import sys

HALF_HEADER = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


async def relentless(port: int, stop: asyncio.Event, opened: list[int]) -> None:
    """One stalled connection, opened again each time it is closed, until ``stop``."""
    while not stop.is_set():
        try:
            async with asyncio.timeout(5):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except (OSError, TimeoutError):
            continue
        opened.append(1)
        writer.write(HALF_HEADER)
        closed = asyncio.ensure_future(reader.read())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            stopped.cancel()
            writer.transport.abort()


async def flood(port: int, sockets: int, seconds: float) -> int:
    stop, opened = asyncio.Event(), []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.call_later(seconds, stop.set)
    await asyncio.gather(*(relentless(port, stop, opened) for _ in range(sockets)),
                         return_exceptions=True)
    return len(opened)


def main() -> None:
    port, sockets, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    print(asyncio.run(flood(port, sockets, seconds)), flush=True)


if __name__ == "__main__":
    main()
