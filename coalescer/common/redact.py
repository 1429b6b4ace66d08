"""URLs fit to show: every password replaced by ``***`` (logs, banners, errors, reprs)."""

from __future__ import annotations

import re

HIDDEN = "***"

# scheme://rest-of-the-token; a token ends at whitespace or a quote.
_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s'\"<>]*)")
# ?password=... or &password=... (redis-py reads a unix socket's password this way)
_QUERY_SECRET_RE = re.compile(r"(?i)([?&](?:password|pass|pwd)=)[^&#\s'\"<>]*")


def redact(text: str) -> str:
    """``text`` with the password of every URL in it hidden: ``redis://:***@host:6379/0``,
    ``rediss://user:***@host``, ``unix:///run/redis.sock?password=***``.

    ``text`` is one URL, or any message (a log line, an error) that may hold URLs.
    """
    return _URL_RE.sub(_redact_match, text)


def _redact_match(match: re.Match[str]) -> str:
    rest = match.group("rest")
    end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found != -1:
            end = min(end, found)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{HIDDEN}@{host}" if colon else f"{userinfo}@{host}"
    tail = _QUERY_SECRET_RE.sub(lambda m: m.group(1) + HIDDEN, tail)
    return match.group("scheme") + netloc + tail
