"""Who may do what over HTTP: bearer tokens, each with a name (the audit log's "who") and
a role, ``read`` (every GET) or ``operator`` (everything), from ``COALESCER_TOKEN``,
``COALESCER_READ_TOKEN`` and ``COALESCER_TOKEN_FILE`` (``tokens_from_env``). What each
role may do, the file's format and the answers (401, 403 naming the role needed,
``GET /whoami``): docs/http.md, "Tokens and roles".
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from coalescer.errors import CoalescerError
from coalescer.web.requests import Refusal

ROLES = ("read", "operator")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CALLER: web.RequestKey[ApiToken]  # the request's ApiToken, for the handlers (set below)
MIN_SECRET = 8  # characters
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenFileError(CoalescerError):
    """The token file cannot be used: the message names the file, line and problem."""


@dataclass(frozen=True, slots=True)
class ApiToken:
    """A bearer token: ``name`` (None for the plain COALESCER_TOKEN, named ``token``
    in the audit log as before), ``role`` and the secret."""

    name: str | None
    role: str
    secret: str = ""

    @property
    def operator(self) -> bool:
        return self.role == "operator"


CALLER = web.RequestKey("coalescer.caller", ApiToken)


def parse_token_file(text: str, source: str) -> list[ApiToken]:
    """The tokens of a token file's ``text``; TokenFileError naming ``source``'s line."""
    tokens: list[ApiToken] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tokens.append(_token_line(line, f"{source}, line {number}"))
    _refuse_repeats(tokens, source)
    return tokens


def _token_line(line: str, where: str) -> ApiToken:
    name, _, rest = line.partition(":")
    role, _, secret = rest.partition(":")
    if not secret:
        raise TokenFileError(f"{where}: expected name:role:secret")
    if not _NAME.fullmatch(name):
        raise TokenFileError(f"{where}: the name {name[:64]!r} must be 1 to 64 letters, "
                             "digits, '.', '_' or '-'")
    if role not in ROLES:
        raise TokenFileError(f"{where}: the role {role[:20]!r} of {name!r} is none of "
                             f"{', '.join(ROLES)}")
    if len(secret) < MIN_SECRET:
        raise TokenFileError(f"{where}: the secret of {name!r} is shorter than "
                             f"{MIN_SECRET} characters")
    return ApiToken(name, role, secret)


def _refuse_repeats(tokens: Sequence[ApiToken], source: str) -> None:
    names = [t.name for t in tokens]
    twice = sorted({n for n in names if n is not None and names.count(n) > 1})
    if twice:
        raise TokenFileError(f"{source}: the name {twice[0]!r} is given more than once")
    if len({t.secret for t in tokens}) < len(tokens):
        raise TokenFileError(f"{source}: two tokens have the same secret")


def tokens_from_env(environ: Mapping[str, str]) -> list[ApiToken]:
    """The named tokens of COALESCER_READ_TOKEN and COALESCER_TOKEN_FILE (the plain
    COALESCER_TOKEN is passed as ``HttpApi(token=...)``, as it always was)."""
    tokens: list[ApiToken] = []
    read = environ.get("COALESCER_READ_TOKEN", "").strip()
    if read:
        tokens.append(ApiToken("read", "read", read))
    path = environ.get("COALESCER_TOKEN_FILE", "").strip()
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"COALESCER_TOKEN_FILE {path}: cannot be read: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        tokens += parse_token_file(text, f"COALESCER_TOKEN_FILE {path}")
    _refuse_repeats(tokens, "the tokens")
    return tokens


def all_tokens(token: str | None, named: Sequence[ApiToken]) -> list[ApiToken]:
    """The plain operator token (if any) and the named ones."""
    plain = [ApiToken(None, "operator", token)] if token else []
    return plain + list(named)


def _bearer(request: web.Request) -> bytes | None:
    """The bearer token sent, or None: absent, another scheme, or bytes that are not
    UTF-8 (aiohttp keeps those as surrogates, which do not encode)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    try:
        return value.strip().encode()
    except UnicodeEncodeError:
        return None


def _holder(given: bytes, tokens: Sequence[ApiToken]) -> ApiToken | None:
    found = None
    for token in tokens:  # every one compared, in constant time each
        if hmac.compare_digest(given, token.secret.encode()):
            found = token
    return found


def roles_middleware(tokens: Sequence[ApiToken], open_paths: Sequence[str]) -> Any:
    """401 without a known token (but on ``open_paths``), 403 for a read-only token
    on a state-changing method; the caller's token kept on the request (CALLER)."""
    known = list(tokens)

    @web.middleware
    async def roles(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        given = _bearer(request)
        holder = _holder(given, known) if given is not None else None
        if holder is None:
            response = Refusal(401, "missing or wrong bearer token "
                                    "(send 'Authorization: Bearer <token>')").response()
            response.headers["WWW-Authenticate"] = 'Bearer realm="coalescer"'
            return response
        if request.method not in READ_METHODS and not holder.operator:
            return Refusal(403, f"{request.method} {request.path} needs a token with the "
                                f"operator role; token {holder.name!r} has the "
                                f"{holder.role} role", role_needed="operator",
                           role=holder.role).response()
        request[CALLER] = holder
        return await handler(request)

    return roles


def caller(request: web.Request) -> ApiToken | None:
    """The token the request was let in with (None: the API takes no token)."""
    return request.get(CALLER)


async def whoami(request: web.Request) -> web.Response:
    """GET /whoami: the caller's token name and role; without tokens, everyone is an
    operator (``{"name": null, "role": "operator", "auth": false}``)."""
    holder = caller(request)
    if holder is None:
        return web.json_response({"name": None, "role": "operator", "auth": False})
    return web.json_response({"name": holder.name or "token", "role": holder.role,
                              "auth": True})
