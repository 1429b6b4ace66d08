"""Webhook refresh handlers, against a receiver the test runs."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from multidict import CIMultiDictProxy

from coalescer import Claim, Coalescer
from coalescer.config.rules import HttpHandler
from coalescer.worker.webhooks import SIGNATURE_HEADER, WebhookError, Webhooks, safe_url, signature
from tests.helpers.servers import free_port, wait_until

SECRET_ENV = "COALESCER_TEST_HOOK_SECRET"
SECRET = "hook-secret-4f1c9a"

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Hit:
    method: str
    path: str  # raw (still percent-encoded)
    headers: CIMultiDictProxy[str]
    body: bytes
    peer_port: int
    at: float

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """A webhook receiver on 127.0.0.1: records every request, answers from a script.

    The n-th request gets ``answers[n]``; the last answer repeats.
    """

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self.answers: list[Answer] = [self.ok]
        self.release = asyncio.Event()  # set at teardown: hanging answers return
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.hits.append(Hit(request.method, request.raw_path, request.headers,
                             await request.read(), peer[1] if peer else 0, time.monotonic()))
        answer = self.answers[min(len(self.hits), len(self.answers)) - 1]
        return await answer(request)

    def hits_at(self, prefix: str) -> list[Hit]:
        return [hit for hit in self.hits if hit.path.startswith(prefix)]

    # -- answers --

    @staticmethod
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    @staticmethod
    def status(code: int, text: str = "") -> Answer:
        async def answer(request: web.Request) -> web.StreamResponse:
            return web.Response(status=code, text=text)
        return answer

    async def hang(self, request: web.Request) -> web.StreamResponse:
        await self.release.wait()
        return web.Response(status=200)

    @staticmethod
    def redirect(location: str) -> Answer:
        async def answer(request: web.Request) -> web.StreamResponse:
            return web.Response(status=302, headers={"Location": location})
        return answer


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[Receiver]:
    started = Receiver()
    await started.start()
    yield started
    await started.close()


@pytest_asyncio.fixture
async def webhooks() -> AsyncIterator[Webhooks]:
    caller = Webhooks()
    yield caller
    await caller.close()


def claim(**fields: Any) -> Claim:
    values: dict[str, Any] = {
        "key": "stats:org:7", "rule": "org-stats", "params": {"org_id": "7"}, "attempt": 1,
        "first_touch_ms": 1000, "last_touch_ms": 2000, "due_ms": 2050, "token": 3}
    values.update(fields)
    return Claim(**values)


def expected_signature(hit: Hit) -> str:
    """The signature the receiver expects of ``hit``: its header's timestamp, within
    a minute of now, and the HMAC of timestamp, method, raw path and body."""
    stamp = int(hit.headers[SIGNATURE_HEADER].split(",")[0].removeprefix("t="))
    assert abs(stamp - time.time()) < 60
    signed = f"{stamp}.{hit.method}.{hit.path}.".encode() + hit.body
    return f"t={stamp},v1=" + hmac.new(SECRET.encode(), signed, hashlib.sha256).hexdigest()


# --- Webhooks on its own --------------------------------------------------------------


def test_signature_covers_timestamp_method_path_and_body() -> None:
    body = b'{"key":"k"}'
    mac = hmac.new(SECRET.encode(), b'1700000000.POST./r/7?x=1.{"key":"k"}', hashlib.sha256)
    wanted = f"t=1700000000,v1={mac.hexdigest()}"
    for secret in (SECRET, SECRET.encode()):
        assert signature(secret, timestamp=1700000000, method="POST", path="/r/7?x=1",
                         body=body) == wanted
    others = {signature(SECRET, timestamp=1700000001, method="POST", path="/r/7?x=1",
                        body=body),
              signature(SECRET, timestamp=1700000000, method="PUT", path="/r/7?x=1",
                        body=body),
              signature(SECRET, timestamp=1700000000, method="POST", path="/r/8?x=1",
                        body=body),
              signature(SECRET, timestamp=1700000000, method="POST", path="/r/7?x=1",
                        body=body + b" ")}
    assert len(others) == 4 and wanted not in others


def test_safe_url_hides_credentials() -> None:
    assert safe_url("http://user:pw@127.0.0.1:9/x?y=1") == "http://user:***@127.0.0.1:9/x?y=1"
    assert safe_url("http://127.0.0.1:9/x") == "http://127.0.0.1:9/x"


async def test_call_posts_the_claim_as_json_on_a_pooled_connection(
        receiver: Receiver, webhooks: Webhooks) -> None:
    spec = HttpHandler(url=receiver.url("/refresh/{org_id}"))
    await webhooks.call(spec, claim(), 5.0)
    await webhooks.call(spec, claim(attempt=2, token=4), 5.0)
    first, second = receiver.hits
    assert (first.method, first.path) == ("POST", "/refresh/7")
    assert first.headers["Content-Type"] == "application/json"
    assert SIGNATURE_HEADER not in first.headers  # no secret_env: unsigned
    assert first.json() == claim().to_json()
    assert second.json()["attempt"] == 2
    assert first.peer_port == second.peer_port  # one pooled keep-alive connection


async def test_call_uses_the_method_and_quotes_captures(
        receiver: Receiver, webhooks: Webhooks) -> None:
    spec = HttpHandler(url=receiver.url("/r/{org_id}"), method="PUT")
    await webhooks.call(spec, claim(params={"org_id": "a b/c?d"}), 5.0)
    assert (receiver.hits[0].method, receiver.hits[0].path) == ("PUT", "/r/a%20b%2Fc%3Fd")


@pytest.mark.parametrize(("capture", "sent"), [
    ("..", "%2E%2E"), (".", "%2E"), ("...", "%2E%2E%2E"), ("%2E%2E", "%252E%252E"),
    ("../admin", "%2E%2E%2Fadmin"), ("..\\x", "%2E%2E%5Cx"), ("%2e.", "%252e%2E"),
    ("v1.2", "v1%2E2"),
])
async def test_a_capture_never_leaves_its_path_segment(
        receiver: Receiver, webhooks: Webhooks, capture: str, sent: str) -> None:
    spec = HttpHandler(url=receiver.url("/tenants/{id}/refresh"))
    await webhooks.call(spec, claim(params={"id": capture}), 5.0)
    assert [hit.path for hit in receiver.hits] == [f"/tenants/{sent}/refresh"]


async def test_the_url_template_literal_text_is_encoded_once(
        receiver: Receiver, webhooks: Webhooks) -> None:
    spec = HttpHandler(url=receiver.url("/a b/%41/{id}?q=1"))
    await webhooks.call(spec, claim(params={"id": "x"}), 5.0)
    assert receiver.hits[0].path == "/a%20b/A/x?q=1"  # %41 is "A", an unreserved letter


async def test_call_signs_the_exact_body_and_never_logs_the_secret(
        receiver: Receiver, webhooks: Webhooks, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    caplog.set_level(logging.DEBUG)
    spec = HttpHandler(url=receiver.url("/hook"), secret_env=SECRET_ENV)
    await webhooks.call(spec, claim(), 5.0)
    hit = receiver.hits[0]
    assert hit.headers[SIGNATURE_HEADER] == expected_signature(hit)
    receiver.answers = [Receiver.status(500)]
    with pytest.raises(WebhookError) as failed:
        await webhooks.call(spec, claim(), 5.0)
    assert SECRET not in str(failed.value)
    assert SECRET not in caplog.text


async def test_the_signature_covers_the_method_and_the_encoded_path_as_sent(
        receiver: Receiver, webhooks: Webhooks, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    spec = HttpHandler(url=receiver.url("/r/{org_id}?v=1"), method="PUT",
                       secret_env=SECRET_ENV)
    await webhooks.call(spec, claim(params={"org_id": "../x y"}), 5.0)
    hit = receiver.hits[0]
    assert (hit.method, hit.path) == ("PUT", "/r/%2E%2E%2Fx%20y?v=1")
    assert hit.headers[SIGNATURE_HEADER] == expected_signature(hit)


async def test_a_missing_secret_names_the_variable(
        receiver: Receiver, webhooks: Webhooks, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    spec = HttpHandler(url=receiver.url("/hook"), secret_env=SECRET_ENV)
    with pytest.raises(WebhookError, match=SECRET_ENV):
        await webhooks.call(spec, claim(), 5.0)
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(WebhookError, match=f"{SECRET_ENV}.*not set or empty"):
        await webhooks.call(spec, claim(), 5.0)
    assert receiver.hits == []  # nothing is sent unsigned


async def test_non_2xx_raises_with_status_url_and_excerpt(
        receiver: Receiver, webhooks: Webhooks) -> None:
    receiver.answers = [Receiver.status(503, "overloaded,\n  try later " + "x" * 1000)]
    spec = HttpHandler(url=receiver.url("/hook"))
    with pytest.raises(WebhookError) as failed:
        await webhooks.call(spec, claim(), 5.0)
    message = str(failed.value)
    assert "503" in message
    assert receiver.url("/hook") in message
    assert "overloaded, try later" in message
    assert len(message) < 400  # an excerpt, not the whole body


async def test_a_redirect_is_not_followed(receiver: Receiver, webhooks: Webhooks) -> None:
    receiver.answers = [Receiver.redirect("/elsewhere")]
    with pytest.raises(WebhookError, match=r"302.*/elsewhere, not followed"):
        await webhooks.call(HttpHandler(url=receiver.url("/hook")), claim(), 5.0)
    assert receiver.hits_at("/elsewhere") == []


async def test_a_hanging_receiver_times_out(receiver: Receiver, webhooks: Webhooks) -> None:
    receiver.answers = [receiver.hang]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.2s"):
        await webhooks.call(HttpHandler(url=receiver.url("/hook"), timeout=0.2), claim(), 30.0)
    assert 0.15 < time.monotonic() - started < 2.0
    with pytest.raises(TimeoutError, match=r"within 0\.1s"):  # no own timeout: the rule's
        await webhooks.call(HttpHandler(url=receiver.url("/hook")), claim(), 0.1)


async def test_connection_refused_is_a_webhook_error(webhooks: Webhooks) -> None:
    spec = HttpHandler(url=f"http://127.0.0.1:{free_port()}/hook")
    with pytest.raises(WebhookError, match="failed"):
        await webhooks.call(spec, claim(), 5.0)


async def test_close_then_call_opens_a_new_session(receiver: Receiver,
                                                   webhooks: Webhooks) -> None:
    spec = HttpHandler(url=receiver.url("/hook"))
    await webhooks.call(spec, claim(), 5.0)
    await webhooks.close()
    await webhooks.close()
    await webhooks.call(spec, claim(), 5.0)
    assert len(receiver.hits) == 2


# --- webhook rules on a real node -----------------------------------------------------


RULES = """\
namespace: {ns}
claim_lease: 2s
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  timeout: 2s
  retry: {{attempts: {attempts}, backoff: 50ms, max_backoff: 100ms}}
rules:
  - name: org-stats
    match: "stats:org:{{org_id}}"
    handler:
      http:
        url: "http://127.0.0.1:{port}/refresh/{{org_id}}"
        timeout: 300ms
        secret_env: {secret_env}
"""

NodeFactory = Callable[..., Awaitable[Coalescer]]


@pytest_asyncio.fixture
async def make_node(redis_url: str, namespace: str, tmp_path: Path,
                    receiver: Receiver) -> AsyncIterator[NodeFactory]:
    opened: list[Coalescer] = []

    async def make(*, attempts: int = 3) -> Coalescer:
        rules = tmp_path / "rules.yaml"
        rules.write_text(textwrap.dedent(RULES.format(
            ns=namespace, attempts=attempts, port=receiver.port, secret_env=SECRET_ENV)))
        node = Coalescer.from_yaml(rules, redis_url=redis_url, worker=True, node_id="n1")
        await node.start()
        opened.append(node)
        return node

    yield make
    for node in opened:
        await node.close()


def refreshes(node: Coalescer, outcome: str) -> float:
    value = node.metrics.registry.get_sample_value(
        "coalescer_refreshes_total", {"rule": "org-stats", "outcome": outcome})
    return value or 0.0


async def settled(node: Coalescer) -> dict[str, Any]:
    """The rule's status once nothing is pending or in flight."""
    async def quiet() -> dict[str, Any] | None:
        entry: dict[str, Any] = (await node.query.status())["rules"]["org-stats"]
        return entry if entry["pending"] == 0 and entry["in_flight"] == 0 else None
    result: dict[str, Any] = await wait_until(quiet, timeout=5, message="the rule to settle")
    return result


async def test_a_500_is_retried_and_the_body_is_signed(
        make_node: NodeFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    receiver.answers = [Receiver.status(500, "boom"), Receiver.ok]
    node = await make_node()
    before_ms = time.time() * 1000
    node.touch("stats:org:acme 1")
    await wait_until(lambda: refreshes(node, "success") == 1, timeout=5,
                     message="the retry to succeed")
    first, second = receiver.hits
    for hit in (first, second):
        assert hit.path == "/refresh/acme%201"
        assert hit.headers["Content-Type"] == "application/json"
        assert hit.headers[SIGNATURE_HEADER] == expected_signature(hit)
    one, two = first.json(), second.json()
    assert set(one) == {"key", "rule", "params", "attempt", "first_touch_ms",
                        "last_touch_ms", "due_ms", "token", "items", "items_overflowed"}
    assert (one["key"], one["rule"], one["params"]) == (
        "stats:org:acme 1", "org-stats", {"org_id": "acme 1"})
    assert (one["attempt"], two["attempt"]) == (1, 2)
    assert one["first_touch_ms"] == one["last_touch_ms"]
    assert abs(one["first_touch_ms"] - before_ms) < 5000  # server clock, epoch ms
    assert one["due_ms"] - one["last_touch_ms"] == 50  # the window
    assert isinstance(one["token"], int)
    assert two["token"] > one["token"]  # fencing tokens grow per claim
    assert refreshes(node, "failure") == 1
    assert (await settled(node))["dead"] == 0


async def test_a_dot_dot_key_reaches_its_own_path_not_the_parent(
        make_node: NodeFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    node = await make_node()
    node.touch("stats:org:..")
    node.touch("stats:org:.")
    await wait_until(lambda: refreshes(node, "success") == 2, timeout=5,
                     message="both refreshes to succeed")
    assert sorted(hit.path for hit in receiver.hits) == ["/refresh/%2E", "/refresh/%2E%2E"]


async def test_a_hanging_receiver_trips_the_timeout_and_the_retry(
        make_node: NodeFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    receiver.answers = [receiver.hang, Receiver.ok]
    node = await make_node()
    node.touch("stats:org:7")
    await wait_until(lambda: refreshes(node, "success") == 1, timeout=5,
                     message="the retry to succeed")
    first, second = receiver.hits
    assert [first.json()["attempt"], second.json()["attempt"]] == [1, 2]
    assert second.at - first.at >= 0.3  # the webhook's own 300ms timeout, then a backoff
    assert refreshes(node, "timeout") == 1
    assert (await settled(node))["dead"] == 0


async def test_a_redirect_fails_until_dead_lettered(
        make_node: NodeFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    receiver.answers = [Receiver.redirect("/elsewhere")]
    node = await make_node(attempts=2)
    node.touch("stats:org:7")
    entry = await wait_until(lambda: _dead(node), timeout=5, message="a dead letter")
    assert entry["dead"] == 1
    status = await node.query.status()
    (letter,) = status["dead_letters"]
    assert letter["key"] == "stats:org:7"
    assert letter["attempts"] == 2
    assert "302" in letter["error"]
    assert [hit.json()["attempt"] for hit in receiver.hits] == [1, 2]
    assert receiver.hits_at("/elsewhere") == []
    assert refreshes(node, "failure") == 2


async def test_a_missing_secret_is_a_failure_that_names_it(
        make_node: NodeFactory, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    node = await make_node(attempts=1)
    node.touch("stats:org:7")
    await wait_until(lambda: _dead(node), timeout=5, message="a dead letter")
    (letter,) = (await node.query.status())["dead_letters"]
    assert SECRET_ENV in letter["error"]
    assert receiver.hits == []


async def _dead(node: Coalescer) -> dict[str, Any] | None:
    entry: dict[str, Any] = (await node.query.status())["rules"]["org-stats"]
    return entry if entry["dead"] and not entry["in_flight"] and not entry["pending"] else None



# --- The receiver snippet of docs/http.md ----------------------------------------------


def docs_verified(monkeypatch: pytest.MonkeyPatch) -> Callable[..., bool]:
    text = (Path(__file__).parents[2] / "docs" / "http.md").read_text()
    start = text.index("```python", text.index("A receiver verifies the signature"))
    code = text[start + len("```python"):text.index("```", start + 3)]
    monkeypatch.setenv("ORG_HOOK_SECRET", SECRET)
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/http.md", "exec"), scope)
    verify: Callable[..., bool] = scope["verified"]
    return verify


def test_the_docs_receiver_snippet_accepts_signed_and_refuses_forged_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    verified = docs_verified(monkeypatch)
    body, now = b'{"key":"k"}', int(time.time())
    good = signature(SECRET, timestamp=now, method="POST", path="/r/%2E%2E", body=body)
    hexed = good.split(",v1=")[1]
    assert verified("POST", "/r/%2E%2E", body, good)
    refused = [None, "", hexed, "sha256=" + hexed, good[:-1] + "g", good[:-1] + "\u00e9",
               good + "\n", good.split(",")[0], good + ",v1=" + hexed, "t=\u0661,v1=" + hexed,
               signature(SECRET, timestamp=now - 301, method="POST", path="/r/%2E%2E",
                         body=body),
               signature("other", timestamp=now, method="POST", path="/r/%2E%2E", body=body)]
    for header in refused:
        assert not verified("POST", "/r/%2E%2E", body, header), header
    assert not verified("POST", "/r", body, good)
    assert not verified("PUT", "/r/%2E%2E", body, good)
    assert not verified("POST", "/r/%2E%2E", body + b" ", good)


# --- a receiver's answer is stored escaped ---------------------------------------------

FORGING = "\x1b[2J\x1b[H\x1b]52;c;ZXZpbA==\x07\u202eFAKE"


def _unforgeable(message: str) -> None:
    for raw in ("\x1b", "\x07", "\u202e", "\n"):
        assert raw not in message, message
    assert "\\x1b[2J" in message and "\\x07" in message and "\\u202e" in message


async def test_a_receivers_error_body_is_stored_escaped_and_capped(
        receiver: Receiver, webhooks: Webhooks) -> None:
    receiver.answers = [Receiver.status(500, "boom " + FORGING + "y" * 5000)]
    with pytest.raises(WebhookError) as failed:
        await webhooks.call(HttpHandler(url=receiver.url("/hook")), claim(), 5.0)
    _unforgeable(str(failed.value))
    assert len(str(failed.value)) < 400


async def _raw_answer(webhooks: Webhooks, answer: bytes) -> str:
    """The error of a webhook call answered ``answer`` (raw bytes) by a receiver that
    aiohttp's server cannot be: it refuses to send control characters."""
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(reply, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(WebhookError) as failed:
            await webhooks.call(HttpHandler(url=f"http://127.0.0.1:{port}/hook"), claim(), 5.0)
    finally:
        server.close()
        await server.wait_closed()
    return str(failed.value)


def _escaped(message: str) -> None:
    for raw in ("\x1b", "\x07", "\u202e", "\u2028", "\n"):
        assert raw not in message, message
    assert len(message) < 500, message


@pytest.mark.parametrize("location", [
    "/x" + FORGING + "z" * 5000,  # what aiohttp itself refuses to send
    "/x\u202eFAKE\u2028" + "z" * 5000,  # UTF-8 bidi override and line separator
], ids=["control-bytes", "unicode-controls"])
async def test_a_receivers_location_is_stored_escaped_and_capped(
        webhooks: Webhooks, location: str) -> None:
    message = await _raw_answer(webhooks, b"HTTP/1.1 302 Found\r\nContent-Length: 0\r\n"
                                          b"Location: " + location.encode() + b"\r\n\r\n")
    assert "302 Found (redirect to /x\\" in message and "not followed" in message
    _escaped(message)


async def test_a_receivers_malformed_answer_is_stored_escaped(webhooks: Webhooks) -> None:
    message = await _raw_answer(webhooks, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"
                                          b"X-\x1b[2J" + "\u202e".encode() + b"z" * 5000
                                          + b": y\r\n\r\n")
    assert "failed:" in message
    _escaped(message)


async def test_a_batch_receivers_error_texts_are_kept_escaped(
        receiver: Receiver, webhooks: Webhooks) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"failed": {"stats:org:7": "bad " + FORGING}})

    receiver.answers = [answer]
    failed = await webhooks.call_batch(HttpHandler(url=receiver.url("/batch")), [claim()], 5.0)
    assert isinstance(failed, dict)
    _unforgeable(failed["stats:org:7"])
