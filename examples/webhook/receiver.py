"""A service refreshed by coalescer's webhook: verifies, applies, keeps the highest token.

    WEBHOOK_SECRET=... python -m examples.webhook.receiver [--port PORT]

It listens on 127.0.0.1, port ``--port``, else ``$PORT``, else 8090: the port the
webhook URL of rules.yaml beside it names (change that URL too when you change the port).

``POST /refresh/{report_id}`` with the claim as its JSON body:

* the ``X-Coalescer-Signature: t=<unix seconds>,v1=<hex>`` header must carry a
  timestamp within 5 minutes of this machine's clock and the HMAC-SHA256, keyed with
  ``$WEBHOOK_SECRET``, of ``<t>.<METHOD>.<raw path>.<exact body bytes>``, checked
  before the body is parsed; a missing, malformed, old or wrong one is answered 401
  and nothing is applied;
* a claim whose token is not larger than the highest already applied for its key is
  a late or repeated delivery (delivery is at least once): acknowledged with 200 and
  ``"applied": false``, never applied over newer work. (A 4xx would make coalescer
  retry a request that can never succeed.)

``GET /applied`` shows, per key, the token applied last and how many refreshes applied.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import os
import re
import time
from typing import Any

from aiohttp import web

from examples.ports import add_port_option, announce, chosen_port

SECRET_ENV = "WEBHOOK_SECRET"
DEFAULT_PORT = 8090  # the port of the webhook url in rules.yaml beside this file
SIGNATURE_HEADER = "X-Coalescer-Signature"

log = logging.getLogger(__name__)


MAX_SKEW = 300  # seconds a signature's timestamp may differ from this machine's clock
_SIGNATURE_RE = re.compile(r"t=([0-9]{1,12}),v1=([0-9a-f]{64})")


def verified(secret: bytes, method: str, path: str, body: bytes, header: str | None) -> bool:
    """True if ``header`` signs this request, with a timestamp within ``MAX_SKEW`` of
    now; False for anything else (missing, malformed, non-ASCII, old, wrong)."""
    found = _SIGNATURE_RE.fullmatch(header) if header is not None else None
    if found is None or abs(int(found.group(1)) - time.time()) > MAX_SKEW:
        return False
    signed = f"{found.group(1)}.{method}.{path}.".encode() + body
    expected = hmac.new(secret, signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, found.group(2))


class Reports:
    """The receiving service's state: the highest token applied per key."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.rebuilds: dict[str, int] = {}

    def apply(self, key: str, token: int) -> bool:
        """Rebuild ``key``'s report unless a claim with a token >= ``token`` did."""
        if token <= self.tokens.get(key, 0):
            return False
        # A real service rebuilds the report here, then records the token with it
        # (in one transaction, when it lives in a database).
        self.tokens[key] = token
        self.rebuilds[key] = self.rebuilds.get(key, 0) + 1
        return True


def _claim(body: bytes) -> tuple[str, int]:
    claim: Any = json.loads(body)
    if not isinstance(claim, dict):
        raise ValueError("the body must be a JSON object")
    key, token = claim.get("key"), claim.get("token")
    if not isinstance(key, str) or not isinstance(token, int) or isinstance(token, bool):
        raise ValueError("the body must carry a string 'key' and an integer 'token'")
    return key, token


def make_app(secret: bytes) -> web.Application:
    reports = Reports()

    async def refresh(request: web.Request) -> web.Response:
        body = await request.read()  # the raw bytes: the signature covers exactly these
        if not verified(secret, request.method, request.raw_path, body,
                        request.headers.get(SIGNATURE_HEADER)):
            log.warning("refused %s: missing or wrong %s", request.path, SIGNATURE_HEADER)
            return web.json_response({"error": "missing or wrong signature"}, status=401)
        try:
            key, token = _claim(body)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        applied = reports.apply(key, token)
        log.info("%s token %d: %s", key, token, "applied" if applied else "stale, ignored")
        return web.json_response({"key": key, "token": token, "applied": applied})

    async def applied(request: web.Request) -> web.Response:
        return web.json_response({key: {"token": token, "rebuilds": reports.rebuilds[key]}
                                  for key, token in reports.tokens.items()})

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_post("/refresh/{report_id}", refresh)
    app.router.add_get("/applied", applied)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.webhook.receiver",
                                     description="The webhook example's receiver.")
    parser.add_argument("--host", default="127.0.0.1")
    add_port_option(parser, DEFAULT_PORT)
    args = parser.parse_args(argv)
    port, source = chosen_port(parser, args.port, DEFAULT_PORT)
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        parser.exit(2, f"{parser.prog}: set {SECRET_ENV} to the secret the node signs with\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    announce("the webhook receiver", args.host, port, source)
    if port != DEFAULT_PORT:
        print(f"examples/webhook/rules.yaml posts to port {DEFAULT_PORT}: make its url name "
              f"port {port}", flush=True)
    web.run_app(make_app(secret.encode()), host=args.host, port=port, access_log=None)


if __name__ == "__main__":
    main()
