"""The HTTP API against hostile requests: every one that is not a valid touch gets a
JSON 4xx and applies nothing; /healthz says when touches are not reaching Redis."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from typing import Any

import pytest
import redis.asyncio

from tests.helpers.servers import ValkeyProcess, free_port, wait_until
from tests.web.test_api import NodeFactory, make_node, metric  # noqa: F401 (make_node: a fixture)

DEEP_LIST = b'{"keys": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_OBJECT = b'{"keys": [], "x": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}"


@pytest.mark.parametrize(("raw", "says"), [
    pytest.param(b'{"keys": ' + b"[" * 1000, "malformed JSON", id="1000-open-brackets"),
    pytest.param(DEEP_LIST, "nested too deeply", id="deep-list"),
    pytest.param(DEEP_OBJECT, "nested too deeply", id="deep-object"),
    pytest.param(b'{"keys": [' + b"1" * 5000 + b"]}", "a number of 5000 digits",
                 id="5000-digit-int"),
    pytest.param(b'{"keys": [NaN]}', "NaN is not a JSON value", id="nan"),
    pytest.param(b'{"keys": [Infinity]}', "Infinity is not a JSON value", id="infinity"),
    pytest.param(b'{"keys": -Infinity}', "-Infinity is not a JSON value", id="-infinity"),
    pytest.param(b'{"keys": ["stats:user:1"], "keys": []}', "field 'keys' appears twice",
                 id="duplicate-field"),
    pytest.param(b'{"keys": ["stats:user:\xff"]}', "not UTF-8", id="bad-utf8"),
    pytest.param(b'{"keys": ["stats:user:\xed\xa0\x80"]}', "not UTF-8", id="utf8-surrogate"),
    pytest.param(b'\xef\xbb\xbf{"keys": ["stats:user:1"]}', "malformed JSON", id="bom"),
    pytest.param(b"\x00" * 10, "malformed JSON", id="nul-bytes"),
])
async def test_a_hostile_body_is_a_json_400_and_applies_nothing(
        make_node: NodeFactory, raw: bytes, says: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, body, response = await node.request(
        "POST", "/touch", data=raw, headers={"Content-Type": "application/json"})
    assert status == 400, body
    assert response.content_type == "application/json"
    assert says in body["error"]
    assert await node.pending() == 0


@pytest.mark.parametrize(("escaped", "key", "says"), [
    ("stats:user:\\ud800", "stats:user:\ud800", "lone surrogate"),
    ("stats:user:\\udcff", "stats:user:\udcff", "lone surrogate"),
    ("stats:user:1\\u00002", "stats:user:1\x002", "NUL character"),
    ("stats:user:" + "9" * 1100, "stats:user:" + "9" * 1100, "over the limit of 1024"),
], ids=["lone-surrogate", "surrogate-escape", "nul", "too-long"])
async def test_a_key_redis_cannot_store_is_a_422_naming_it_and_later_touches_are_written(
        make_node: NodeFactory, escaped: str, key: str, says: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    raw = ('{"keys": ["stats:user:1", "%s"]}' % escaped).encode()  # noqa: UP031
    status, body, response = await node.request(
        "POST", "/touch", data=raw, headers={"Content-Type": "application/json"})
    assert status == 422
    assert response.content_type == "application/json"
    assert says in body["error"] and "nothing was touched" in body["error"]
    [invalid] = body["invalid_keys"]
    assert invalid["index"] == 1 and invalid["key"] == key and says in invalid["error"]
    assert await node.pending() == 0  # not even stats:user:1

    assert await node.touch({"keys": ["stats:user:2"]}) == (202, {"accepted": 1})
    assert await node.pending() == 1  # the node still writes
    status, health, _ = await node.request("GET", "/healthz")
    assert (status, health) == (200, {"ok": True})


@pytest.mark.parametrize(("content_type", "raw", "expected", "says"), [
    ("multipart/form-data; boundary=x", b'--x\r\n\r\n{"keys": []}\r\n--x--', 415, "multipart"),
    ("application/json; charset=utf-16", '{"keys": []}'.encode("utf-16"), 415, "utf-16"),
    ("application/x-www-form-urlencoded", b"keys=stats:user:1", 415, "urlencoded"),
    ("text/html", b"<html></html>", 415, "'text/html' is not accepted"),
    # what a page on another origin can send without asking first: JSON typed as text
    ("text/plain", b'{"keys": ["stats:user:1"]}', 415, "'text/plain' is not accepted"),
    ("application/x-www-form-urlencoded", b'{"keys": ["stats:user:1"]}', 415, "urlencoded"),
    (None, b'{"keys": ["stats:user:1"]}', 415, "a body needs 'Content-Type: application/json'"),
    ("application/json", b'{"keys": ["stats:user:1"]}', 202, None),
    ("Application/JSON; charset=UTF-8", b'{"keys": ["stats:user:1"]}', 202, None),
], ids=["multipart", "utf-16", "form", "html", "text-plain-json", "form-typed-json",
        "no-type", "json", "json-utf8"])
async def test_a_body_must_be_declared_json(
        make_node: NodeFactory, content_type: str | None, raw: bytes,  # noqa: F811
        expected: int, says: str | None) -> None:
    node = await make_node(worker=False)
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, body, response = await node.request(
        "POST", "/touch", data=raw, headers=headers,
        skip_auto_headers=() if content_type else ("Content-Type",))
    assert status == expected, body
    assert response.content_type == "application/json"
    if says is None:
        assert body == {"accepted": 1}
        assert await node.pending() == 1
    else:
        assert says in body["error"]
        assert await node.pending() == 0


async def test_a_body_that_does_not_decompress_is_a_json_400(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, body, _ = await node.request("POST", "/touch", data=b"not gzip", headers=headers)
    assert status == 400
    assert "cannot be read" in body["error"] and "gzip" in body["error"]
    good = gzip.compress(json.dumps({"keys": ["stats:user:1"]}).encode())
    assert (await node.request("POST", "/touch", data=good, headers=headers))[:2] == (
        202, {"accepted": 1})


@pytest.mark.parametrize("framing", ["Content-Length: 1000", "Transfer-Encoding: chunked"])
async def test_a_client_leaving_mid_body_logs_one_line_and_no_traceback(
        make_node: NodeFactory, caplog: pytest.LogCaptureFixture,  # noqa: F811
        framing: str) -> None:
    node = await make_node(worker=False)
    caplog.set_level(logging.DEBUG)
    _reader, writer = await asyncio.open_connection("127.0.0.1", node.api.port)
    head = (f"POST /touch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()
    part = b'{"keys": ["stats:user:1"'
    if "chunked" in framing:
        part = f"{len(part):x}\r\n".encode() + part + b"\r\n"
    writer.write(head + part)
    await writer.drain()
    writer.close()
    await writer.wait_closed()

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "left before the body ended" in r.getMessage()]

    await wait_until(logged, timeout=5, message="the disconnect to be logged")
    assert len(logged()) == 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert await node.pending() == 0
    assert (await node.request("GET", "/healthz"))[0] == 200  # still serving


# --- /healthz: the oldest unwritten touch -----------------------------------------------


async def _health(node: Any) -> tuple[int, Any]:
    status, body, response = await node.request("GET", "/healthz")
    assert response.content_type == "application/json"
    return status, body


async def test_healthz_is_503_while_a_touch_waits_on_a_read_only_redis(
        own_server: ValkeyProcess, make_node: NodeFactory) -> None:  # noqa: F811
    server = own_server  # requested first: it outlives the node, and is stopped after
    node = await make_node(worker=False, url=server.url, max_unwritten_age=0.3)
    admin = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        await admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        assert await node.touch({"keys": ["stats:user:1"]}) == (202, {"accepted": 1})

        async def unhealthy() -> Any:
            status, body = await _health(node)
            return body if status == 503 and "oldest" in body["error"] else None

        body = await wait_until(unhealthy, timeout=10, message="/healthz to say 503")
        assert body["ok"] is False
        assert "oldest unwritten touch" in body["error"] and "bound 0.3 s" in body["error"]
        assert "Redis refuses writes: READONLY" in body["error"]
        assert "not reachable" not in body["error"]  # Redis answers; it refuses writes
        assert body["unwritten_age_s"] >= 0.3  # shown to a tenth of a second

        await admin.execute_command("REPLICAOF", "NO", "ONE")
        await node.c.flush()
        assert await _health(node) == (200, {"ok": True})
        assert await node.pending() == 1  # written, not dropped
    finally:
        await admin.aclose()


async def test_healthz_is_503_with_both_reasons_while_redis_is_stopped(
        own_server: ValkeyProcess, make_node: NodeFactory) -> None:  # noqa: F811
    server = own_server
    try:
        node = await make_node(worker=False, url=server.url, max_unwritten_age=0.3)
        assert await _health(node) == (200, {"ok": True})
        server.stop()
        assert await node.touch({"keys": ["stats:user:1"]}) == (202, {"accepted": 1})

        async def stale() -> Any:
            status, body = await _health(node)
            return body if status == 503 and "oldest unwritten" in body["error"] else None

        body = await wait_until(stale, timeout=15, message="/healthz to name the old touch")
        assert "Redis is not reachable" in body["error"]
        server.start()

        async def healthy() -> bool:
            return await _health(node) == (200, {"ok": True})

        await wait_until(healthy, timeout=15, message="/healthz back to 200")
        assert await node.pending() == 1
    finally:
        server.start()


async def test_healthz_and_metrics_show_a_dropped_key(
        make_node: NodeFactory, redis_client: Any) -> None:  # noqa: F811
    node = await make_node(worker=False)
    await redis_client.hset(node.c.keyspace.shard(0).meta, "stats:user:bad", "P|corrupt")
    status, _ = await node.touch({"keys": ["stats:user:1", "stats:user:bad", "stats:user:2"]})
    assert status == 202
    assert await node.pending() == 2  # flushes: the bad key is dropped, the others written

    status, body = await _health(node)
    assert status == 200 and body["ok"] is True  # a dropped key does not stop the node
    assert body["dropped_keys"] == 1  # a count: the open /healthz names no key
    assert "stats:user:bad" not in json.dumps(body)
    _, text, _ = await node.request("GET", "/metrics")
    assert metric(text, "coalescer_dropped_keys_total", reason="redis_error") == 1


def test_healthz_bound_must_be_positive() -> None:
    from coalescer.web.api import HttpApi
    with pytest.raises(ValueError, match="max_unwritten_age"):
        HttpApi(object(), max_unwritten_age=0)  # type: ignore[arg-type]

