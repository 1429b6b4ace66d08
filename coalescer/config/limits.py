"""The rules file's ``limits:`` setting: how much the write surface takes in before it
refuses (pending keys), and how many dead letters are kept, for how long."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PENDING_KEYS = 1_000_000
DEFAULT_DEAD_LETTERS = 10_000
DEFAULT_DEAD_LETTER_TTL = 7 * 24 * 3600.0  # seconds
MAX_COUNT = 1_000_000_000
LIMIT_FIELDS = ("pending_keys", "dead_letters", "dead_letter_ttl")


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """``pending_keys``: keys waiting for their refresh, past which a touch of a new key
    is refused (all shards); ``dead_letters``: dead letters kept (all shards and rules),
    the oldest dropped past it; ``dead_letter_ttl``: seconds a dead letter is kept."""

    pending_keys: int = DEFAULT_PENDING_KEYS
    dead_letters: int = DEFAULT_DEAD_LETTERS
    dead_letter_ttl: float = DEFAULT_DEAD_LETTER_TTL

    def dead_letters_per_shard(self, shards: int) -> int:
        """Each shard's share of ``dead_letters`` (rounded up)."""
        return -(-self.dead_letters // shards)


DEFAULT_LIMITS = Limits()
