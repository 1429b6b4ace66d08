"""How long a key may be: every layer refuses a longer one before anything else is done
with it (matching it to a rule included)."""

from __future__ import annotations

MAX_KEY_BYTES = 1024  # in UTF-8


def over_limit(key: str) -> str | None:
    """Why ``key`` is too long (a cheap check: its length in characters), or None."""
    if len(key) > MAX_KEY_BYTES:
        return (f"it is {len(key)} characters long, over the limit of {MAX_KEY_BYTES} "
                "bytes in UTF-8")
    return None
