"""URLs fit to show: every password replaced by ``***`` (logs, banners, errors, reprs)."""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://rest-of-the-token; a token ends at whitespace or a quote.
_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>]*)")
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# ?password=... or &password=... (redis-py reads a unix socket's password this way)
_QUERY_SECRET_RE = re.compile(r"(?i)([?&](?:password|pass|pwd)=)[^&#\s'\"<>]*")


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
    if at:
        user, colon, _password = userinfo.partition(":")
        head = f"{user}:{HIDDEN}@" if colon else f"{userinfo}@"
    else:
        after = rest
    end = min((found for found in (after.find(c) for c in "/?#") if found != -1),
              default=len(after))
    netloc, tail = after[:end], after[end:]
    return head + netloc + _QUERY_SECRET_RE.sub(lambda m: m.group(1) + HIDDEN, tail)
