"""The claim object a refresh handler receives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """One claimed refresh of one key: what the handler is asked to do.

    Times are server-clock epoch milliseconds. ``token`` is the fencing token:
    it grows with every claim of the key, so a downstream store can refuse a
    write that carries a smaller token than one it has already seen.
    """

    key: str
    rule: str
    params: dict[str, str] = field(default_factory=dict)
    attempt: int = 1
    first_touch_ms: int = 0
    last_touch_ms: int = 0
    due_ms: int = 0
    token: int = 0

    def to_json(self) -> dict[str, Any]:
        """The fields under their public names, as a webhook body carries them."""
        return asdict(self)
