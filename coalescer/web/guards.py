"""Guards of a node's HTTP API against a browser used by an attacker: the middlewares
``host_guard`` (DNS rebinding, a node without a token only), ``cross_site_guard``,
``json_body_guard`` and ``security_headers`` (with the page's ``page_csp``), registered
by ``HttpApi.make_app``. What each refuses and why: docs/http.md, "Exposing the HTTP
API safely".
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDictProxy

from coalescer.web.requests import Refusal

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})
DEFAULT_PORTS = {"http": 80, "https": 443}
STRICT_CSP = "default-src 'none'; frame-ancestors 'none'"
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                  "Referrer-Policy": "no-referrer"}
_INLINE = re.compile(rb"<(script|style)(?:\s[^>]*)?>(.*?)</\1\s*>", re.DOTALL | re.IGNORECASE)
_PORT = re.compile(r"[0-9]{1,5}")


# --- addresses -------------------------------------------------------------------------


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(host: str) -> bool:
    """True if ``host`` (an address or "localhost") only listens on this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    address = _ip(host)
    return address is not None and address.is_loopback  # a name may resolve outside


def split_host(value: str) -> tuple[str, int | None] | None:
    """(lower-case host without brackets, port or None) of a ``Host`` header value;
    None when it is not one (empty, not ASCII, unbracketed IPv6, a bad port)."""
    if not value or not value.isascii() or not value.isprintable() or " " in value:
        return None
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        host, colon, port_text = value.partition(":")
        port = port_text if colon else None
        if ":" in port_text:
            return None
    if not host or any(c in host for c in "/@\\?#") or (
            port is not None and not _PORT.fullmatch(port)):
        return None
    return host.lower(), None if port is None else int(port)


# --- Host (DNS rebinding) --------------------------------------------------------------


def accepted_hosts(bound: str) -> str:
    """What ``host_guard`` accepts, in words, for its refusals and the docs."""
    names = "localhost, 127.0.0.1 (any 127.x address) or [::1]"
    if bound.strip("[]").lower() in WILDCARDS:
        return f"{names}, or an IP address (the node listens on every one)"
    if is_loopback(bound):
        return names
    return f"{names}, or {bound}"


def host_allowed(value: str, bound: str) -> bool:
    """True if a request with ``Host: value`` may be answered by a node bound to
    ``bound`` without a token: a loopback name or address, the bound address, or (bound
    to a wildcard) any IP address; a DNS name other than these never."""
    parsed = split_host(value)
    if parsed is None:
        return False
    host = parsed[0]
    bound = bound.strip("[]").lower()
    if is_loopback(host) or host == bound:
        return True
    return bound in WILDCARDS and _ip(host) is not None


def host_guard(bound: str) -> Any:
    """The middleware refusing (421) a ``Host`` a node without a token does not answer
    to. A request without ``Host`` (HTTP/1.0; never a browser) is answered."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is None or host_allowed(host, bound):
            return await handler(request)
        return Refusal(421, f"this node has no token and answers only requests sent to "
                            f"{accepted_hosts(bound)}, not to Host {host!r}; use one of "
                            "those, or give the node a token",
                       host=host).response()

    return guard


# --- cross-site requests ---------------------------------------------------------------


def _origin(value: str) -> tuple[str, int] | None:
    """(host, port) of an ``Origin`` header ("scheme://host[:port]"); None if malformed."""
    scheme, sep, rest = value.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS:
        return None
    parsed = split_host(rest)
    if parsed is None:
        return None
    host, port = parsed
    return host, DEFAULT_PORTS[scheme] if port is None else port


def _same_origin(origin: str, host: str) -> bool:
    """True if ``origin`` names the host and port of ``host``; the scheme is not compared
    (behind a TLS proxy the node itself speaks plain HTTP), a ``Host`` without a port
    stands for the default port of the origin's scheme."""
    source = _origin(origin)
    target = split_host(host)
    if source is None or target is None:
        return False
    scheme = origin.partition("://")[0].lower()
    port = DEFAULT_PORTS[scheme] if target[1] is None else target[1]
    return (target[0], port) == source


def cross_site_problem(headers: CIMultiDictProxy[str]) -> str | None:
    """Why a request that may change something is refused as cross-site; None if not."""
    site = headers.get("Sec-Fetch-Site", "").lower()
    if site in ("cross-site", "same-site"):
        return (f"a request from another site (Sec-Fetch-Site: {site}) cannot change "
                "anything here; use this node's own page or a client without a browser")
    origin = headers.get("Origin")
    if origin is None:
        return None  # not a browser: curl, another server
    host = headers.get("Host", "")
    if origin.strip().lower() == "null":
        return ("a request from an opaque origin (Origin: null) cannot change anything "
                "here; use this node's own page or a client without a browser")
    if not _same_origin(origin, host):
        return (f"a request from origin {origin!r} cannot change anything on {host!r}: "
                "the origin must be this node's own; use its page, or a client that "
                "sends no Origin")
    return None


@web.middleware
async def cross_site_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse (403) a state-changing request a browser sent from another origin."""
    if request.method in SAFE_METHODS:
        return await handler(request)
    problem = cross_site_problem(request.headers)
    if problem is not None:
        return Refusal(403, problem).response()
    return await handler(request)


# --- content type ----------------------------------------------------------------------


def content_type_problem(request: web.Request) -> str | None:
    """Why a state-changing request's body is refused for its type; None if not.
    A request without a body may omit ``Content-Type``."""
    if "Content-Type" not in request.headers:
        if not request.body_exists:
            return None
        return "a body needs 'Content-Type: application/json'"
    if request.content_type != "application/json":
        return (f"Content-Type {request.content_type!r} is not accepted; send the body "
                "as 'Content-Type: application/json'")
    return None


@web.middleware
async def json_body_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse (415) a state-changing request whose body is not declared JSON. Requests
    no route takes are left to their 404 or 405."""
    if request.method in SAFE_METHODS or request.match_info.http_exception is not None:
        return await handler(request)
    problem = content_type_problem(request)
    if problem is not None:
        return Refusal(415, problem).response()
    return await handler(request)


# --- response headers ------------------------------------------------------------------


def _hash(source: bytes) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source).digest()).decode() + "'"


def _sources(hashes: list[str]) -> str:
    return " ".join(hashes) or "'none'"


def page_csp(html: bytes) -> str:
    """The Content-Security-Policy of a page: its inline scripts and styles allowed by
    their sha256 (computed from ``html`` itself), nothing else loaded but fetches to
    the page's own origin, no framing, no form posts, no <base>."""
    blocks = [(m.group(1).lower(), _hash(m.group(2))) for m in _INLINE.finditer(html)]
    scripts = [digest for kind, digest in blocks if kind == b"script"]
    styles = [digest for kind, digest in blocks if kind == b"style"]
    return "; ".join(["default-src 'none'", f"script-src {_sources(scripts)}",
                      f"style-src {_sources(styles)}", "connect-src 'self'",
                      "frame-ancestors 'none'", "form-action 'none'", "base-uri 'none'"])


def security_headers(html_csp: str) -> Any:
    """The middleware adding ``COMMON_HEADERS`` to every answer, and a CSP: ``html_csp``
    on HTML (the status page), ``STRICT_CSP`` on the rest."""

    @web.middleware
    async def headers(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        for name, value in COMMON_HEADERS.items():
            response.headers.setdefault(name, value)
        html = response.content_type == "text/html"
        response.headers.setdefault("Content-Security-Policy", html_csp if html else STRICT_CSP)
        return response

    return headers
