"""Counted nouns in messages: "1 shard", "2 shards", "touched 1 key"."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, plural unless ``n`` is 1: ``plural(2, "key")`` is "2 keys"."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {many or word + 's'}"


def noun(n: int, word: str, many: str | None = None) -> str:
    """``word``, plural unless ``n`` is 1, without the number: "field", "fields"."""
    return word if n == 1 else (many or word + "s")
