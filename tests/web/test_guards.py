"""The guards of the HTTP API, over real HTTP against a real node: a rebinding ``Host``,
cross-site and mistyped state changes, an undecodable ``Authorization``, a bug's 500,
the security headers, and a bind open to the network without a token."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from html.parser import HTMLParser
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from coalescer.web.api import HttpApi, OpenApiError
from coalescer.web.guards import cross_site_problem, host_allowed, split_host
from tests.helpers.servers import free_port
from tests.web.test_api import TOKEN, NodeFactory, make_node  # noqa: F401 (make_node: a fixture)

TOUCH = b'{"keys": ["stats:user:1"]}'


async def raw_http(port: int, head: str, body: bytes = b"",
                   extra: bytes = b"") -> tuple[int, dict[str, str], Any]:
    """Send one request as written (``extra``: raw header lines, any bytes) on a fresh
    connection; (status, headers, JSON body or text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        lines = head.encode() + extra + f"Content-Length: {len(body)}\r\n".encode()
        writer.write(lines + b"Connection: close\r\n\r\n" + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    top, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    text = payload.decode()
    is_json = headers.get("content-type", "").startswith("application/json")
    return int(status_line.split()[1]), headers, json.loads(text) if is_json else text


# --- Host: DNS rebinding ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["/status", "/", "/healthz", "/metrics", "/due"])
async def test_without_a_token_a_rebinding_host_is_refused_on_every_route(
        make_node: NodeFactory, path: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    host = f"attacker.example:{node.api.port}"
    status, headers, body = await raw_http(node.api.port, f"GET {path} HTTP/1.1\r\n"
                                                          f"Host: {host}\r\n")
    assert status == 421, body
    assert headers["content-type"].startswith("application/json")
    assert body["host"] == host
    assert f"not to Host {host!r}" in body["error"] and "localhost" in body["error"]


async def test_without_a_token_a_rebinding_host_touches_nothing(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, _, body = await raw_http(
        node.api.port, "POST /touch HTTP/1.1\r\nHost: attacker.example\r\n"
                       "Content-Type: application/json\r\n", TOUCH)
    assert status == 421, body
    assert await node.pending() == 0


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST",
                                  "localhost.:1", "127.0.0.2:9999", "[::1]:{port}",
                                  "[::ffff:127.0.0.1]"])
async def test_without_a_token_loopback_hosts_are_answered_whatever_the_port(
        make_node: NodeFactory, host: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, _, body = await raw_http(
        node.api.port, f"GET /status HTTP/1.1\r\nHost: {host.format(port=node.api.port)}\r\n")
    assert status == 200, body
    assert "rules" in body


async def test_with_a_token_the_host_is_not_checked_the_token_is(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, token=TOKEN)
    head = "GET /status HTTP/1.1\r\nHost: attacker.example\r\n"
    status, _, body = await raw_http(node.api.port, head,
                                     extra=f"Authorization: Bearer {TOKEN}\r\n".encode())
    assert status == 200 and "rules" in body
    status, _, body = await raw_http(node.api.port, head)
    assert status == 401, body


@pytest.mark.parametrize(("host", "bound", "allowed"), [
    ("localhost", "127.0.0.1", True),
    ("127.8.9.10:1", "127.0.0.1", True),
    ("[::1]", "::1", True),
    ("node.lan:8470", "node.lan", True),  # the name it was told to bind to
    ("NODE.LAN", "node.lan", True),
    ("192.0.2.7:8470", "192.0.2.7", True),
    ("192.0.2.8:8470", "192.0.2.7", False),
    ("192.0.2.8", "0.0.0.0", True),  # bound to every address: any IP literal
    ("[2001:db8::1]:80", "::", True),
    ("attacker.example", "0.0.0.0", False),  # a name can be rebound; an address cannot
    ("localhost.attacker.example", "127.0.0.1", False),
    ("127.0.0.1.attacker.example", "127.0.0.1", False),
    ("", "127.0.0.1", False),
    ("::1", "127.0.0.1", False),  # IPv6 without brackets is not a Host
    ("[::1", "127.0.0.1", False),
    ("localhost:port", "127.0.0.1", False),
    ("localhost:123456", "127.0.0.1", False),
    ("local host", "127.0.0.1", False),
    ("user@localhost", "127.0.0.1", False),
    ("l\u00f6calhost", "127.0.0.1", False),
    ("localhost\udcff", "127.0.0.1", False),  # a non-UTF-8 byte, as aiohttp keeps it
])
def test_which_hosts_a_node_without_a_token_answers(host: str, bound: str,
                                                    allowed: bool) -> None:
    assert host_allowed(host, bound) is allowed


def test_a_host_header_splits_into_name_and_port() -> None:
    assert split_host("Example.COM:8080") == ("example.com", 8080)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("[::1]") == ("::1", None)
    assert split_host("[::1]x") is None
    assert split_host("a:1:2") is None


# --- cross-site state changes ----------------------------------------------------------


@pytest.mark.parametrize(("headers", "expected", "says"), [
    ({"Sec-Fetch-Site": "cross-site"}, 403, "Sec-Fetch-Site: cross-site"),
    ({"Sec-Fetch-Site": "same-site"}, 403, "Sec-Fetch-Site: same-site"),
    ({"Origin": "http://evil.example"}, 403, "origin 'http://evil.example'"),
    ({"Origin": "http://127.0.0.1:{other}"}, 403, "the origin must be this node's own"),
    ({"Origin": "null"}, 403, "Origin: null"),
    ({"Origin": "garbage"}, 403, "origin 'garbage'"),
    ({"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "cross-site"}, 403,
     "cross-site"),
    ({}, 202, None),  # curl, another server: no Origin
    ({"Origin": "http://127.0.0.1:{port}"}, 202, None),
    ({"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}, 202, None),
    ({"Sec-Fetch-Site": "none"}, 202, None),  # typed by the user, not sent by a page
], ids=["cross-site", "same-site", "other-origin", "other-port", "null",
        "garbage", "same-origin-but-cross-site", "no-origin", "same-origin",
        "same-origin-fetch", "user-initiated"])
async def test_a_state_change_from_another_origin_is_403_and_applies_nothing(
        make_node: NodeFactory, headers: dict[str, str], expected: int,  # noqa: F811
        says: str | None) -> None:
    node = await make_node(worker=False)
    sent = {k: v.format(port=node.api.port, other=free_port()) for k, v in headers.items()}
    status, body = await node.touch({"keys": ["stats:user:1"]}, headers=sent)
    assert status == expected, body
    if says is None:
        assert await node.pending() == 1
    else:
        assert says in body["error"]
        assert await node.pending() == 0


@pytest.mark.parametrize(("origin", "host", "same"), [
    ("https://node.example", "node.example", True),  # behind a TLS proxy
    ("https://node.example", "node.example:443", True),
    ("http://node.example", "NODE.example:80", True),
    ("http://node.example:8080", "node.example", False),
    ("http://node.example", "node.example:8080", False),
    ("https://node.example.evil", "node.example", False),
    ("http://[::1]:8470", "[::1]:8470", True),
    ("ftp://node.example", "node.example", False),
    ("http://node.example/path", "node.example", False),
])
def test_an_origin_is_the_nodes_own_when_it_names_its_host_and_port(
        origin: str, host: str, same: bool) -> None:
    headers = CIMultiDictProxy(CIMultiDict({"Origin": origin, "Host": host}))
    assert (cross_site_problem(headers) is None) is same


async def test_reads_from_another_origin_are_not_refused_by_the_cross_site_guard(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)  # (a browser still cannot read them: no CORS)
    status, body, _ = await node.request("GET", "/status", headers={
        "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
    assert status == 200 and "rules" in body


async def test_a_route_added_later_is_guarded_and_may_take_no_body(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    called: list[str] = []

    async def delete(request: web.Request) -> web.Response:
        called.append(request.match_info["key"])
        return web.json_response({"deleted": True})

    app = HttpApi(node.c, port=0).make_app()
    app.router.add_delete("/later/{key:.+}", delete)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/later/stats:user:1"
    try:
        async with node.http.delete(url, headers={"Origin": "http://evil.example"}) as answer:
            assert answer.status == 403
        async with node.http.delete(url, data=b"x",
                                    headers={"Content-Type": "text/plain"}) as answer:
            assert answer.status == 415
        assert called == []
        async with node.http.delete(url) as answer:  # no body, no type: allowed
            assert answer.status == 200, await answer.text()
        assert called == ["stats:user:1"]
    finally:
        await runner.cleanup()


async def test_unknown_routes_and_methods_keep_their_404_and_405(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, body, _ = await node.request("POST", "/nope", data=b"x",
                                         headers={"Content-Type": "text/plain"})
    assert status == 404, body
    status, body, _ = await node.request("PUT", "/touch", data=b"x",
                                         headers={"Content-Type": "text/plain"})
    assert status == 405, body


# --- Authorization and 500s ------------------------------------------------------------


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer caf\xe9", b"\xc3(",
                                   b"Bearer " + TOKEN.encode() + b"\x80"])
async def test_an_undecodable_authorization_is_401(make_node: NodeFactory,  # noqa: F811
                                                    value: bytes) -> None:
    node = await make_node(worker=False, token=TOKEN)
    status, headers, body = await raw_http(
        node.api.port, "GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n",
        extra=b"Authorization: " + value + b"\r\n")
    assert status == 401, body
    assert "bearer token" in body["error"]
    assert headers["www-authenticate"] == 'Bearer realm="coalescer"'


@pytest.mark.parametrize(("header", "expected"), [
    (b"Host: local\xffhost", 421), (b"Origin: http://127.0.0.1\xff", 403),
    (b"Sec-Fetch-Site: cross\xff", 202), (b"Content-Type: application/js\xffon", 415),
    (b"Content-Type: application/json; charset=\xff", 415)])
async def test_undecodable_bytes_in_a_checked_header_are_refused_not_a_500(
        make_node: NodeFactory, header: bytes, expected: int) -> None:  # noqa: F811
    node = await make_node(worker=False)
    host = b"" if header.startswith(b"Host") else b"Host: 127.0.0.1\r\n"
    ctype = b"" if header.startswith(b"Content-Type") else b"Content-Type: application/json\r\n"
    status, _, body = await raw_http(node.api.port, "POST /touch HTTP/1.1\r\n", TOUCH,
                                     extra=host + ctype + header + b"\r\n")
    assert status == expected, body
    assert await node.pending() == (1 if expected == 202 else 0)


async def test_a_bug_answers_500_without_its_text_and_is_logged_once(
        make_node: NodeFactory, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    node = await make_node(worker=False)

    def broken(keys: list[str]) -> list[str]:
        raise RuntimeError("secret detail of the bug")

    node.c.unknown_keys = broken  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR, logger="coalescer")
    status, body = await node.touch({"keys": ["stats:user:1"]})
    assert (status, body) == (500, {"error": "internal error"})
    [record] = [r for r in caplog.records
                if r.name.startswith("coalescer") and r.levelno >= logging.ERROR]
    assert "POST /touch failed" in record.getMessage()
    assert "secret detail of the bug" in record.getMessage()
    assert await node.pending() == 0


# --- response headers ------------------------------------------------------------------


class InlineBlocks(HTMLParser):
    """The text of each inline <script> and <style> of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.blocks: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.blocks:
            self._open = tag
            self.blocks[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.blocks[self._open][-1] += data


def sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


async def test_the_page_is_served_with_a_csp_of_its_own_hashes_and_no_framing(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, html, response = await node.request("GET", "/")
    assert status == 200
    parser = InlineBlocks()
    parser.feed(html)
    [script], [style] = parser.blocks["script"], parser.blocks["style"]
    directives = dict(d.strip().partition(" ")[::2]
                      for d in response.headers["Content-Security-Policy"].split(";"))
    assert directives == {
        "default-src": "'none'", "script-src": sha256(script), "style-src": sha256(style),
        "connect-src": "'self'", "frame-ancestors": "'none'", "form-action": "'none'",
        "base-uri": "'none'"}
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["Referrer-Policy"] == "no-referrer"


@pytest.mark.parametrize(("method", "path"), [("GET", "/healthz"), ("GET", "/status"),
                                              ("GET", "/nope"), ("POST", "/touch")])
async def test_every_answer_is_nosniff_and_loads_nothing(
        make_node: NodeFactory, method: str, path: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    _, _, response = await node.request(method, path, data=b"x",
                                        headers={"Content-Type": "text/plain"})
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["Content-Security-Policy"] == (
        "default-src 'none'; frame-ancestors 'none'")


# --- binding open to the network -------------------------------------------------------


@pytest.mark.parametrize(("host", "shown"), [("0.0.0.0", "0.0.0.0:8470"),
                                             ("::", "[::]:8470"),
                                             ("node.lan", "node.lan:8470")])
def test_a_non_loopback_bind_without_a_token_is_refused(host: str, shown: str) -> None:
    with pytest.raises(OpenApiError) as refused:
        HttpApi(object(), host=host, port=8470)  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"on {shown} without a token" in message
    assert "COALESCER_TOKEN=<secret>" in message and "bind it to 127.0.0.1" in message
    assert "allow_open=True" in message and "\n" not in message


def test_a_loopback_bind_or_a_token_needs_no_flag() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        HttpApi(object(), host=host)  # type: ignore[arg-type]
    HttpApi(object(), host="0.0.0.0", token="s3cret")  # type: ignore[arg-type]


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1:{port}", 200), ("192.0.2.8:{port}", 200), ("[2001:db8::1]", 200),
    ("attacker.example:{port}", 421)])
async def test_allow_open_on_every_address_answers_ip_hosts_and_refuses_names(
        make_node: NodeFactory, host: str, expected: int) -> None:  # noqa: F811
    node = await make_node(worker=False)
    # the app of a node told to bind 0.0.0.0, served on loopback: never open in a test
    app = HttpApi(node.c, host="0.0.0.0", allow_open=True).make_app()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = int(runner.addresses[0][1])
    try:
        status, _, body = await raw_http(port, f"GET /status HTTP/1.1\r\n"
                                               f"Host: {host.format(port=port)}\r\n")
    finally:
        await runner.cleanup()
    assert status == expected, body
