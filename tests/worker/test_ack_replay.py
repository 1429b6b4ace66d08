"""An ack whose reply is lost to a connection reset is sent again by the client; its
first try had reached Redis. The replay gets the first try's answer: no false "claim
... was taken over" warning, and no "lost" refresh in the history."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from coalescer import Coalescer
from coalescer.store.script_calls import script_source
from tests.helpers.servers import HOST, ValkeyProcess, wait_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 100ms
    absorb: 10ms
    handler: handlers:refresh
"""
HANDLERS = """\
async def refresh(claim):
    pass
"""


class ReplyCutter:
    """A TCP proxy to a real server that, once, forwards a request carrying ``marker``
    and then closes the client's connection instead of delivering the server's reply
    (a NOSCRIPT reply, which changed nothing, is delivered and does not count)."""

    def __init__(self, target_port: int, marker: bytes) -> None:
        self.target_port = target_port
        self.marker = marker
        self.armed = True
        self.cut = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(HOST, self.target_port)
        link = _Link(self, client_w, server_w)
        for coro in (link.upstream(client_r), link.downstream(server_r)):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


class _Link:
    """One proxied connection of a ReplyCutter."""

    def __init__(self, cutter: ReplyCutter, client_w: asyncio.StreamWriter,
                 server_w: asyncio.StreamWriter) -> None:
        self.cutter = cutter
        self.client_w = client_w
        self.server_w = server_w
        self.watching = False  # the next reply answers the marked request

    async def upstream(self, client_r: asyncio.StreamReader) -> None:
        while data := await client_r.read(65536):
            if self.cutter.armed and self.cutter.marker in data:
                self.watching = True
            self.server_w.write(data)
            await self.server_w.drain()
        self.server_w.close()

    async def downstream(self, server_r: asyncio.StreamReader) -> None:
        while data := await server_r.read(65536):
            if self.watching and data.startswith(b"-NOSCRIPT"):
                self.watching = False  # the script is loaded, then sent again
            elif self.watching:
                self.cutter.armed, self.watching = False, False
                self.cutter.cut += 1
                self.client_w.transport.abort()
                self.server_w.close()
                return
            self.client_w.write(data)
            await self.client_w.drain()
        self.client_w.close()


async def test_a_replayed_ack_is_not_reported_as_taken_over(
        rules_file: Callable[..., Path], namespace: str, own_server: ValkeyProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    ack_sha = hashlib.sha1(script_source("ack").encode()).hexdigest().encode()
    proxy = ReplyCutter(own_server.port, b"EVALSHA\r\n$40\r\n" + ack_sha)
    await proxy.start()
    caplog.set_level(logging.INFO)
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    c = Coalescer.from_yaml(path, redis_url=f"redis://{HOST}:{proxy.port}/0",
                            node_id="n1", grace=1.0)
    try:
        await c.start()
        c.touch("stats:1")
        await c.flush()
        await wait_until(lambda: proxy.cut == 1, message="an ack's reply to be cut off")

        async def refreshed_once() -> bool:
            history = await c.query.history()
            return [(r.key, r.outcome) for r in history] == [("stats:1", "success")]

        await wait_until(refreshed_once, message="one successful refresh")
        await c.close()
    finally:
        await c.close()
        await proxy.close()
    assert not [r for r in caplog.records if "taken over" in r.getMessage()]
    with own_server.client() as admin:
        status = admin.hgetall(c.keyspace.shard(0).meta)
        outcomes = [entry["outcome"] for _, entry in
                    admin.xrange(c.keyspace.shard(0).history, "-", "+")]
    assert status == {}  # acked once: the key is idle
    assert outcomes == ["success"]  # no "lost" refresh recorded by the replay


async def test_a_stale_ack_is_still_reported(
        rules_file: Callable[..., Path], namespace: str, own_server: ValkeyProcess) -> None:
    """The receipt answers only the very same call: an ack of a claim that a newer
    token holds is refused and reported, as before."""
    path = rules_file(RULES.format(ns=namespace), HANDLERS)
    async with Coalescer.from_yaml(path, redis_url=own_server.url, worker=False) as c:
        shard = c.keyspace.shard(0)
        c.touch("stats:1")
        await c.flush()
        scripts = c._run.scripts
        assert scripts is not None
        from coalescer.store.script_types import History

        history = History("n1", 100)
        stale = await scripts.ack(shard, [("stats", [("stats:1", 999, 0, 0)])], history)
        assert stale == ["stats:1"]
        again = await scripts.ack(shard, [("stats", [("stats:1", 999, 0, 0)])], history)
        assert again == ["stats:1"]  # another call: checked anew, not answered from the receipt
