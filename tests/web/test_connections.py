"""The HTTP API's connection limits against slow and many clients: deadlines on headers,
bodies and idle connections, the cap on open connections, the slots kept for /healthz,
and the summary line that stands for a flood."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import socket
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from coalescer.web.api import HttpApi
from coalescer.web.connections import ConnectionGuard, ConnectionLimits
from tests.helpers.servers import wait_until
from tests.web.test_api import TOKEN, NodeFactory, make_node  # noqa: F401 (make_node: a fixture)

SLOW_HEADER = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow-client\r\n\r\n"
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def closed_count(node: Any, reason: str) -> float:
    value = node.c.metrics.registry.get_sample_value(
        "coalescer_http_connections_closed_total", {"reason": reason})
    return float(value or 0.0)


def open_connections(node: Any) -> float:
    return float(node.c.metrics.registry.get_sample_value("coalescer_http_connections") or 0)


async def connect(node: Any) -> Stream:
    return await asyncio.open_connection("127.0.0.1", node.api.port)


async def server_closed(reader: asyncio.StreamReader, within: float) -> bool:
    """True once the server closed the connection (EOF), False if it is open after
    ``within`` seconds; anything sent meanwhile is read and dropped."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(4096):
                pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


async def healthz_on_a_new_connection(node: Any) -> int:
    async with aiohttp.ClientSession() as http, http.get(node.url + "/healthz") as response:
        return response.status


async def answer(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5):
        return await reader.readuntil(b"\r\n\r\n")


# --- deadlines -----------------------------------------------------------------------


async def test_a_header_sent_a_byte_at_a_time_is_closed_by_the_server_at_its_deadline(
        make_node: NodeFactory, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    node = await make_node(worker=False, header_timeout=1)
    reader, writer = await connect(node)
    sent = 0
    try:
        while sent < len(SLOW_HEADER) and not await server_closed(reader, within=0.5):
            writer.write(SLOW_HEADER[sent:sent + 1])
            sent += 1
    finally:
        writer.transport.abort()
    assert sent < len(SLOW_HEADER) // 2  # cut off long before the header was whole
    assert sent >= 2  # not at once: after about a second of bytes
    assert closed_count(node, "header_timeout") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # summarised later


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, idle_timeout=0.5)
    reader, writer = await connect(node)
    try:
        assert await server_closed(reader, within=5)
    finally:
        writer.transport.abort()


async def test_a_keep_alive_connection_is_closed_after_the_idle_timeout_between_requests(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, idle_timeout=0.5)
    reader, writer = await connect(node)
    try:
        writer.write(SLOW_HEADER)
        assert (await answer(reader)).startswith(b"HTTP/1.1 200")
        assert await server_closed(reader, within=5)
    finally:
        writer.transport.abort()


async def test_a_body_slower_than_its_deadline_is_answered_408_and_touches_nothing(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, body_timeout=0.5)
    reader, writer = await connect(node)
    try:
        writer.write(b"POST /touch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n" + b'{"keys": [')
        head = await answer(reader)
        assert head.startswith(b"HTTP/1.1 408")
        assert b"Connection: close" in head
    finally:
        writer.transport.abort()
    assert closed_count(node, "body_timeout") == 1
    assert await node.pending() == 0


async def test_the_token_is_checked_before_a_huge_declared_body_is_read(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, token=TOKEN)
    reader, writer = await connect(node)
    try:
        writer.write(b"POST /touch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000\r\n\r\n")
        assert (await answer(reader)).startswith(b"HTTP/1.1 401")  # at once, no body sent
    finally:
        writer.transport.abort()


# --- the cap -------------------------------------------------------------------------


async def test_at_the_cap_a_new_connection_closes_the_oldest_unfinished_one(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, max_connections=8)
    streams: list[Stream] = []
    try:
        for i in range(20):
            streams.append(await connect(node))
            streams[-1][1].write(SLOW_HEADER[:20])
            await wait_until(lambda i=i: open_connections(node) == min(i + 1, 8)
                             and closed_count(node, "evicted") == max(0, i - 7),
                             timeout=5, message=f"connection {i} admitted")
        for reader, _ in streams[:12]:
            assert await server_closed(reader, within=5)
        assert not any(reader.at_eof() for reader, _ in streams[12:])
        status, body, _ = await node.request("GET", "/healthz")
        assert (status, body) == (200, {"ok": True})
        assert closed_count(node, "evicted") == 13  # /healthz took the oldest one's slot
        assert await server_closed(streams[12][0], within=5)
    finally:
        for _, writer in streams:
            writer.transport.abort()


async def _stalled_touch(node: Any) -> Stream:
    """A POST /touch whose body stops after 10 of 100 bytes: a request running."""
    reader, writer = await connect(node)
    writer.write(b"POST /touch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b'\r\nContent-Length: 100\r\n\r\n{"keys": [')
    return reader, writer


async def test_running_requests_never_take_the_slot_kept_for_healthz_which_says_503_meanwhile(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, max_connections=4)  # 1 kept for /healthz
    streams = [await _stalled_touch(node) for _ in range(3)]
    try:
        async def busy() -> Any:
            status, body, response = await node.request(
                "POST", "/touch", json={"keys": ["stats:user:1"]})
            return (body, response.headers) if status == 503 else None

        body, headers = await wait_until(busy, timeout=5, message="a 503 for the 4th request")
        assert "running 3 requests already" in body["error"]
        assert headers["Retry-After"] == "1"
        # a load balancer takes the node out of rotation: it cannot take touches
        status, health, _ = await node.request("GET", "/healthz")
        assert status == 503 and health["ok"] is False
        assert health["reasons"] == [
            "every request slot is taken: 3 requests running (the cap of 4 connections "
            "less 1 kept for /healthz), so touches are answered 503"]
        assert health["error"] == health["reasons"][0]
        assert closed_count(node, "busy") >= 1
    finally:
        for _, writer in streams:
            writer.transport.abort()

    async def healthy() -> bool:
        return (await node.request("GET", "/healthz"))[:2] == (200, {"ok": True})

    await wait_until(healthy, timeout=5, message="/healthz back to 200 once the slots freed")
    assert await node.touch({"keys": ["stats:user:1"]}) == (202, {"accepted": 1})


async def test_the_flood_summary_is_one_warning_line_with_the_counts(
        make_node: NodeFactory, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    node = await make_node(worker=False, max_connections=2)
    streams = [await connect(node) for _ in range(5)]
    try:
        for _, writer in streams:
            writer.write(SLOW_HEADER[:5])
        await wait_until(lambda: closed_count(node, "evicted") == 3, timeout=5)
    finally:
        for _, writer in streams:
            writer.transport.abort()
    await node.api.close()  # what is counted and not yet logged is logged at close
    lines = [r for r in caplog.records if r.name == "coalescer.web.connections"]
    assert [r.levelname for r in lines] == ["WARNING"]
    assert re.fullmatch(  # the period was not over: the line says how long it was
        r"HTTP API, last \d s: 3 connections over the cap of 2: the oldest idle or "
        r"unfinished closed to make room", lines[0].getMessage())


@pytest.mark.parametrize(("option", "value", "says"), [
    ("max_connections", 1, "max_connections must be a whole number of at least 2 (one is "
                           "kept for /healthz), got 1"),
    ("max_connections", 64.5, "max_connections must be a whole number of at least 2 (one is "
                              "kept for /healthz), got 64.5"),
    ("header_timeout", 0, "header_timeout must be over 0 seconds, got 0"),
    ("body_timeout", -1.0, "body_timeout must be over 0 seconds, got -1.0"),
    ("idle_timeout", float("nan"), "idle_timeout must be over 0 seconds, got nan"),
])
def test_a_limit_out_of_range_is_a_value_error_naming_the_option(
        option: str, value: float, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        HttpApi(object(), **{option: value})  # type: ignore[arg-type]
    assert str(caught.value) == says


# --- the guard on its own --------------------------------------------------------------


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.aborted = self.closed = False

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.aborted or self.closed


class Inner(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


async def test_over_the_cap_a_connection_is_refused_at_once_when_every_one_runs_a_request(
        ) -> None:
    guard = ConnectionGuard(ConnectionLimits(max_connections=2))
    inners: list[Inner] = []

    def make_inner() -> Inner:
        inners.append(Inner())
        return inners[-1]

    gate, started = asyncio.Event(), []

    async def hold(request: Any) -> web.StreamResponse:
        started.append(request.path)
        await gate.wait()
        return web.Response()

    factory, handler = guard.protocol_factory(make_inner), guard.wrap(hold)
    transports = [FakeTransport() for _ in range(3)]
    for transport in transports[:2]:
        factory().connection_made(transport)
    running = [asyncio.create_task(handler(SimpleNamespace(protocol=inner, path=path)))
               for inner, path in zip(inners, ["/touch", "/healthz"], strict=True)]
    await wait_until(lambda: len(started) == 2, timeout=5)

    factory().connection_made(transports[2])
    assert transports[2].aborted and len(inners) == 2  # aiohttp never saw it
    assert not transports[0].aborted and not transports[1].aborted
    gate.set()
    await asyncio.gather(*running)
    factory().connection_made(FakeTransport())  # room again: an idle one is closed for it
    assert transports[0].aborted and len(inners) == 3
    guard.close()


async def test_a_failing_accept_is_counted_for_the_summary_and_accepting_goes_on(
        make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    node = await make_node(worker=False)
    assert (await node.request("GET", "/healthz"))[0] == 200  # the accept already waiting
    loop = asyncio.get_running_loop()
    real, failures = loop.sock_accept, [OSError(errno.EMFILE, os.strerror(errno.EMFILE))] * 3

    async def out_of_files(sock: socket.socket) -> Any:
        if failures:
            raise failures.pop()
        return await real(sock)

    monkeypatch.setattr(loop, "sock_accept", out_of_files)
    assert await healthz_on_a_new_connection(node) == 200  # taken by the waiting accept
    await wait_until(lambda: closed_count(node, "accept_failed") == 3, timeout=5)
    assert await healthz_on_a_new_connection(node) == 200  # accepting went on
    await node.api.close()
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert re.fullmatch(r"HTTP API, last \d s: 3 accepts failed \(Too many open files: raise "
                        r"the file limit \(ulimit -n\)\)", line)
