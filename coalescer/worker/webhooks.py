"""Webhook refresh handlers: the claim POSTed as JSON, optionally signed.

One pooled ``aiohttp.ClientSession`` per node, created on first use. Every non-2xx
answer, connection error or timeout raises, so the runner's retries and dead letter
apply. Redirects are not followed: a 3xx is a failure like any other non-2xx.

A batch rule's webhook gets one request per batch: a JSON list of the claims. A 2xx
answer with no body (or any body without a ``failed`` field) means every key
succeeded; ``{"failed": ["key", ...]}`` or ``{"failed": {"key": "error", ...}}``
names the keys that failed (retried, then dead-lettered, on their own).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

import aiohttp
from yarl import URL

from coalescer.claim import Claim
from coalescer.common.printable import printable
from coalescer.common.redact import redact
from coalescer.config.model import quote_capture
from coalescer.config.rules import HttpHandler
from coalescer.errors import WebhookError

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Coalescer-Signature"
USER_AGENT = "coalescer-webhook/0.1"
EXCERPT_BYTES = 200
SHOWN_CHARS = 200  # of a receiver's Location, reason or error text, once escaped
DRAIN_BYTES = 64 * 1024


def signature(secret: str | bytes, *, timestamp: int, method: str, path: str,
              body: bytes) -> str:
    """The ``X-Coalescer-Signature`` value: ``t=<unix seconds>,v1=<hex>``, where hex is
    the HMAC-SHA256, keyed with ``secret``, of ``<t>.<METHOD>.<path>.<body>``
    (``path`` as sent: percent-encoded, with the query string if any)."""
    key = secret.encode() if isinstance(secret, str) else secret
    mac = hmac.new(key, f"{timestamp}.{method.upper()}.{path}.".encode(), hashlib.sha256)
    mac.update(body)
    return f"t={timestamp},v1={mac.hexdigest()}"


def encode_body(claim: Claim) -> bytes:
    """The exact bytes sent (and signed): the claim's JSON, compact, keys in field order."""
    return json.dumps(claim.to_json(), separators=(",", ":")).encode()


def safe_url(url: str) -> str:
    """``url`` with its password hidden, fit for logs and error messages."""
    return redact(url)


_PLACEHOLDER_RE = re.compile(r"%7B([^%]*)%7D")


def request_url(spec: HttpHandler, params: Mapping[str, str]) -> URL:
    """The URL a claim is sent to, built as already encoded so that nothing (dot
    segments, percent-encoded or not) is normalised away: the template's literal
    text is encoded once, each capture is inserted by ``quote_capture``."""
    template = str(URL(spec.url))  # placeholders come out as %7Bname%7D
    filled = _PLACEHOLDER_RE.sub(
        lambda m: quote_capture(params[unquote(m.group(1))]), template)
    return URL(filled, encoded=True)


def _secret(spec: HttpHandler) -> str | None:
    if not spec.secret_env:
        return None
    value = os.environ.get(spec.secret_env)
    if not value:
        raise WebhookError(f"webhook {spec.method} {safe_url(spec.url)}: environment variable "
                           f"{spec.secret_env} (its secret_env) is not set or empty")
    return value


def _headers(spec: HttpHandler, url: URL, body: bytes) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT}
    secret = _secret(spec)
    if secret is not None:
        headers[SIGNATURE_HEADER] = signature(
            secret, timestamp=int(time.time()), method=spec.method, path=url.raw_path_qs,
            body=body)
    return headers


async def _excerpt(response: aiohttp.ClientResponse) -> str:
    try:
        raw = await response.content.read(EXCERPT_BYTES)
    except (aiohttp.ClientError, TimeoutError):
        return ""
    text = raw.decode("utf-8", errors="replace").strip()
    return _shown(" ".join(text.split()))


def _shown(text: str) -> str:
    """A receiver's text as stored in an error: control characters escaped (no forged
    terminal or log output), at most SHOWN_CHARS characters."""
    escaped = printable(text)
    return escaped if len(escaped) <= SHOWN_CHARS else escaped[:SHOWN_CHARS] + "..."


def encode_batch(claims: list[Claim]) -> bytes:
    """The exact bytes a batch webhook is sent (and signed): a JSON list of claims."""
    return json.dumps([c.to_json() for c in claims], separators=(",", ":")).encode()


def failed_of_answer(raw: bytes, method: str, url: str) -> object:
    """The ``failed`` field of a batch webhook's 2xx answer (None: all succeeded)."""
    text = raw.strip()
    if not text:
        return None
    try:
        answer = json.loads(text)
    except ValueError:
        return None  # a plain "ok" body: every key succeeded
    if not isinstance(answer, dict) or answer.get("failed") is None:
        return None
    failed = answer["failed"]
    if not isinstance(failed, list | dict):
        raise WebhookError(f"webhook {method} {url} answered with a 'failed' field that is "
                           f"neither a list of keys nor a mapping of key to error: "
                           f"{json.dumps(failed)[:EXCERPT_BYTES]}")
    if isinstance(failed, dict):  # the receiver's error texts, kept as stored errors
        return {key: _shown(error) if isinstance(error, str) else error
                for key, error in failed.items()}
    return failed


async def _check(response: aiohttp.ClientResponse, method: str, url: str) -> bytes:
    """The answer's body (up to DRAIN_BYTES) when it is a 2xx; else WebhookError."""
    if 200 <= response.status < 300:
        return await response.content.read(DRAIN_BYTES)  # lets the connection be reused
    status = f"{response.status} {_shown(response.reason or '')}".rstrip()
    location = response.headers.get("Location")
    where = f" (redirect to {_shown(location)}, not followed)" if location else ""
    excerpt = await _excerpt(response)
    detail = f": {excerpt}" if excerpt else ""
    raise WebhookError(f"webhook {method} {url} answered {status}{where}{detail}")


class Webhooks:
    """Calls webhook handlers; implements the core's ``WebhookCaller`` protocol."""

    def __init__(self, *, limit: int = 100) -> None:
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def call(self, spec: Any, claim: Claim, timeout: float) -> None:
        """POST (``spec.method``) the claim to ``request_url`` (captures percent-encoded).

        Raises WebhookError on a non-2xx answer or a connection error, TimeoutError
        when no full answer came within ``spec.timeout`` (else ``timeout``).
        """
        http: HttpHandler = spec
        await self._send(http, request_url(http, claim.params), encode_body(claim), timeout)
        log.debug("webhook %s %s: %s attempt %d ok", http.method, safe_url(http.url),
                  claim.key, claim.attempt)

    async def call_batch(self, spec: Any, claims: list[Claim], timeout: float) -> object:
        """POST the batch (a JSON list of claims) to ``spec.url``; returns the answer's
        ``failed`` field (None when every key succeeded). Raises as ``call`` does."""
        http: HttpHandler = spec
        raw = await self._send(http, request_url(http, {}), encode_batch(claims), timeout)
        return failed_of_answer(raw, http.method, safe_url(http.url))

    async def _send(self, http: HttpHandler, url: URL, body: bytes, timeout: float) -> bytes:
        headers = _headers(http, url, body)
        limit = http.timeout if http.timeout is not None else timeout
        shown = safe_url(str(url))
        try:
            async with self._get_session().request(
                    http.method, url, data=body, headers=headers, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=limit)) as response:
                return await _check(response, http.method, shown)
        except TimeoutError:
            raise TimeoutError(f"webhook {http.method} {shown} did not answer within "
                               f"{limit:g}s") from None
        except aiohttp.ClientError as exc:
            raise WebhookError(f"webhook {http.method} {shown} failed: "
                               f"{type(exc).__name__}: {_shown(str(exc))}") from None

    async def close(self) -> None:
        """Close the pooled session (a later call opens a new one)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
