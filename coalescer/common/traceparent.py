"""How long a W3C ``traceparent`` a producer sends may be: a longer one (an HTTP header,
a Kafka header, a stream entry's field) is left out without being read or decoded."""

from __future__ import annotations

# Version 00 has 55 characters; later versions may add fields after those, and a value
# this long is none that any version sends.
MAX_TRACEPARENT = 512


def read_traceparent(raw: bytes) -> str | None:
    """``raw`` as text (ASCII, anything else replaced), or None when it is longer than
    MAX_TRACEPARENT bytes (then it is not decoded at all)."""
    if len(raw) > MAX_TRACEPARENT:
        return None
    return raw.decode("ascii", "replace")
