"""Real faults between a node and its Redis: a TCP fault proxy, and a server whose clock
the test steps.

``FaultProxy`` listens on 127.0.0.1 and forwards every connection to a real server. It
runs its own event loop in a thread, so a test (and the nodes it starts in its own
loop) talk to it over real sockets. Faults, each changeable at any moment:

* ``latency(seconds)``: every chunk, each way, is delivered that much later (in order);
* ``black_hole()``: connections stay up, nothing is delivered either way; what was sent
  meanwhile is delivered on ``heal()``, as TCP's retransmissions would;
* ``reset()``: every open connection is closed abruptly (RST);
* ``heal()``: no fault.

``SteppedClockServer`` is a real valkey-server run under libfaketime (Debian's
``faketime`` package), whose wall clock ``step(seconds)`` moves at once; its monotonic
clock is left alone, as on a host whose clock NTP or an operator stepped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tests.helpers.servers import HOST, ValkeyProcess

FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port`` that injects faults on demand."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._latency = 0.0
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="fault-proxy")

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def url(self, server_url: str) -> str:
        """``server_url`` with this proxy's port in place of the server's."""
        return server_url.replace(f":{self.target_port}/", f":{self.port}/")

    # -- faults (callable from any thread) --

    def latency(self, seconds: float) -> None:
        self._latency = seconds

    def black_hole(self) -> None:
        self._call(lambda: self._flow().clear())

    def heal(self) -> None:
        self._latency = 0.0
        self._call(lambda: self._flow().set())

    def reset(self) -> None:
        def rst() -> None:
            for writer in list(self._writers):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                writer.transport.abort()
        self._call(rst)

    def retarget(self, port: int) -> None:
        """Send new connections to ``port`` (a failover moved the server there); the
        open ones stay with the old server, and end with it."""
        self.target_port = port

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            self._flow().set()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            _, stuck = await asyncio.wait(tasks, timeout=2) if tasks else ((), ())
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the proxy --

    def _call(self, fn: Any) -> None:
        done = threading.Event()

        def run() -> None:
            fn()
            done.set()
        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def _flow(self) -> asyncio.Event:
        assert self._flowing is not None
        return self._flowing

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                                 return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Read ``src``, deliver to ``dst`` in order, each chunk after the latency in force
        when it was read, and nothing while the hole is open."""
        chunks: deque[tuple[float, bytes]] = deque()
        arrived = asyncio.Event()
        eof = False

        async def deliver() -> None:
            while chunks or not eof:
                if not chunks:
                    arrived.clear()
                    await arrived.wait()
                    continue
                at, data = chunks[0]
                if (wait := at - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                await self._flow().wait()
                chunks.popleft()
                dst.write(data)
                await dst.drain()
            dst.transport.abort()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(65536):
                chunks.append((time.monotonic() + self._latency, data))
                arrived.set()
        finally:
            eof = True
            arrived.set()
            with contextlib.suppress(Exception):
                await sender


class SteppedClockServer(ValkeyProcess):
    """A real valkey-server whose wall clock the test steps (libfaketime)."""

    def __init__(self, dir: Path, **kw: Any) -> None:
        self._offset_file = Path(dir) / "faketime-offset"
        self._offset = 0.0
        super().__init__(dir=dir, **kw)

    @staticmethod
    def available() -> bool:
        return FAKETIME_LIB.exists()

    def start(self) -> ValkeyProcess:
        if self.running:
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_offset()
        env = {**os.environ, "LD_PRELOAD": str(FAKETIME_LIB),
               "FAKETIME_TIMESTAMP_FILE": str(self._offset_file), "FAKETIME_NO_CACHE": "1",
               "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        return self

    def step(self, seconds: float) -> None:
        """Step the server's wall clock by ``seconds`` (either way), at once."""
        self._offset += seconds
        self._write_offset()

    def _write_offset(self) -> None:
        tmp = self._offset_file.with_suffix(".tmp")
        tmp.write_text(f"{self._offset:+.3f}s\n")
        tmp.replace(self._offset_file)
