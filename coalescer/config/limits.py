"""The rules file's ``limits:`` setting: how much the write surface takes in before it
refuses (pending keys and their bytes), how far ahead a touch may be scheduled, and how
many dead letters are kept, for how long."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PENDING_KEYS = 1_000_000
DEFAULT_DEAD_LETTERS = 10_000
DEFAULT_DEAD_LETTER_TTL = 7 * 24 * 3600.0  # seconds
DEFAULT_PENDING_BYTES = 1 << 30  # 1 GiB
DEFAULT_SCHEDULE_AHEAD = 400 * 86_400.0  # seconds (400 days)
MAX_SCHEDULE_AHEAD = 10 * 365 * 86_400.0  # seconds: the most it may be set to (10 years)
MAX_COUNT = 1_000_000_000
MAX_BYTES = 1 << 50
LIMIT_FIELDS = ("pending_keys", "pending_bytes", "max_schedule_ahead", "dead_letters",
                "dead_letter_ttl")


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """``pending_keys``: keys waiting for their refresh, past which a touch of a new key
    is refused (all shards); ``pending_bytes``: bytes of Redis the pending keys hold
    (their names, items and schedules, all shards), past which a touch is refused too;
    ``max_schedule_ahead``: seconds ahead a touch may be scheduled at most (``at``,
    ``delay``); ``dead_letters``: dead letters kept (all shards and rules), the oldest
    dropped past it; ``dead_letter_ttl``: seconds a dead letter is kept."""

    pending_keys: int = DEFAULT_PENDING_KEYS
    pending_bytes: int = DEFAULT_PENDING_BYTES
    max_schedule_ahead: float = DEFAULT_SCHEDULE_AHEAD
    dead_letters: int = DEFAULT_DEAD_LETTERS
    dead_letter_ttl: float = DEFAULT_DEAD_LETTER_TTL

    def dead_letters_per_shard(self, shards: int) -> int:
        """Each shard's share of ``dead_letters`` (rounded up)."""
        return -(-self.dead_letters // shards)


DEFAULT_LIMITS = Limits()
