"""The claim object a refresh handler receives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coalescer.store.script_types import ClaimedKey


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """One claimed refresh of one key: what the handler is asked to do.

    Times are server-clock epoch milliseconds. ``token`` is the fencing token:
    it grows with every claim of the key, so a downstream store can refuse a
    write that carries a smaller token than one it has already seen.

    For a rule with ``items:``, ``items`` holds the distinct items touched with the
    key since its previous claim (sorted; a retry gets a failed try's items again),
    at most the rule's ``items.max``; ``items_overflowed`` is True when more were
    touched than that: ``items`` is then incomplete and the handler should recompute
    the whole aggregate. Both are empty / False for a rule without items.
    """

    key: str
    rule: str
    params: dict[str, str] = field(default_factory=dict)
    attempt: int = 1
    first_touch_ms: int = 0
    last_touch_ms: int = 0
    due_ms: int = 0
    token: int = 0
    items: tuple[str, ...] = ()
    items_overflowed: bool = False

    def to_json(self) -> dict[str, Any]:
        """The fields under their public names, as a webhook body carries them (``items``
        as a JSON list)."""
        out = asdict(self)
        out["items"] = list(self.items)
        return out


# The slots' own setters: a frozen dataclass's keyword __init__ goes through
# object.__setattr__ once a field, three times the cost of these (a drain builds
# thousands of claims a second).
(_SET_KEY, _SET_RULE, _SET_PARAMS, _SET_ATTEMPT, _SET_FIRST, _SET_LAST, _SET_DUE, _SET_TOKEN,
 _SET_ITEMS, _SET_OVERFLOWED) = (
    getattr(Claim, name).__set__ for name in (
        "key", "rule", "params", "attempt", "first_touch_ms", "last_touch_ms", "due_ms", "token",
        "items", "items_overflowed"))
_new = object.__new__


def granted(c: ClaimedKey, rule: str, params: dict[str, str]) -> Claim:
    """The Claim of ``c`` (as the claim script granted it), equal to the one the keyword
    constructor builds, at a third of the cost."""
    claim: Claim = _new(Claim)
    _SET_KEY(claim, c.key)
    _SET_RULE(claim, rule)
    _SET_PARAMS(claim, params)
    _SET_ATTEMPT(claim, c.attempt)
    _SET_FIRST(claim, c.first_ms)
    _SET_LAST(claim, c.last_ms)
    _SET_DUE(claim, c.due_ms)
    _SET_TOKEN(claim, c.token)
    _SET_ITEMS(claim, c.items)
    _SET_OVERFLOWED(claim, c.overflowed)
    return claim
