"""URLs fit to show: every password replaced by ``***`` (logs, banners, errors, reprs)."""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://rest-of-the-token; a token ends at whitespace or a quote.
_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>]*)")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# ?password=... or &password=... (redis-py reads a unix socket's password this way)
# (a ``#`` in the value is hidden with it: a password is more likely than a fragment)
_QUERY_SECRET_RE = re.compile(r"(?i)([?&](?:password|pass|pwd)=)[^&\s'\"<>]*")
# where a URL parser may cut a password typed unencoded
_CUTS = "/?#@"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it hidden: ``redis://:***@host:6379/0``,
    ``rediss://user:***@host``, ``unix:///run/redis.sock?password=***``.

    ``text`` is one URL, or any message (a log line, an error) that may hold URLs. A
    password is hidden however it is spelled: up to the last ``@`` of the URL, so a
    ``/``, ``?``, ``#`` or ``@`` typed in it unencoded is hidden with it.
    """
    return _URL_RE.sub(lambda m: m.group("scheme") + _redact_rest(m.group("rest")), text)


def redact_url(url: str) -> str:
    """``url``, known to be one URL (a setting, an argument), with its password hidden:
    as ``redact``, but the URL runs to the end of the text, so a space or a quote in the
    password is hidden too."""
    found = _SCHEME_RE.match(url)
    if found is None:
        return redact(url)
    return found.group() + _redact_rest(url[found.end():])


def _redact_rest(rest: str) -> str:
    """What follows ``scheme://``, with the password of its user information hidden."""
    userinfo, at, after = rest.rpartition("@")
    head = ""
    if at and _QUERY_SECRET_RE.search(userinfo):  # the "@" is in ?password=...
        at = ""
    if at:
        user, colon, _password = userinfo.partition(":")
        head = f"{user}:{HIDDEN}@" if colon else f"{userinfo}@"
    else:
        after = rest
    end = min((found for found in (after.find(c) for c in "/?#") if found != -1),
              default=len(after))
    netloc, tail = after[:end], after[end:]
    return head + netloc + _QUERY_SECRET_RE.sub(lambda m: m.group(1) + HIDDEN, tail)


def redact_with(text: str, url: str) -> str:
    """``text`` (e.g. a client library's error about ``url``) with the password of ``url``
    hidden: as ``redact``, and also any tail of the password a URL parser cut off at an
    unencoded ``/``, ``?``, ``#`` or ``@`` (redis-py reads ``unix://:pa/ss@/s.sock`` as
    the socket ``/ss@/s.sock`` and names that path in its errors)."""
    shown = redact(text)
    password = _password(url)
    tails = {password[i:] for i, c in enumerate(password) if c in _CUTS}
    for tail in sorted((t for t in tails if len(t) > 1), key=len, reverse=True):
        shown = shown.replace(tail, HIDDEN)
    return shown


def _password(url: str) -> str:
    """The password of ``url``'s user information (``""`` when it has none), read as
    ``redact_url`` reads it: up to the last ``@``."""
    found = _SCHEME_RE.match(url)
    rest = url[found.end():] if found else url
    userinfo, at, _after = rest.rpartition("@")
    if not at or _QUERY_SECRET_RE.search(userinfo):
        return ""
    return userinfo.partition(":")[2]
