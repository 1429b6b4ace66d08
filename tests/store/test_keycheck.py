"""Which keys of a request Redis cannot store, and the one line saying so."""

from __future__ import annotations

from coalescer.store.keycheck import (
    MAX_KEY_BYTES,
    Unstorable,
    unstorable_keys,
    unstorable_message,
)

KEYS = ["item:1", "item:\0", "item:2", "x" * (MAX_KEY_BYTES + 1), "bad:\udcff"]


def test_the_unstorable_keys_are_found_in_order_with_their_index_and_problem() -> None:
    bad = unstorable_keys(KEYS)
    assert [(b.index, b.key) for b in bad] == [(1, "item:\0"), (3, KEYS[3]), (4, "bad:\udcff")]
    assert bad[0].problem == "it contains a NUL character (at index 5)"
    assert "over the limit of 1024" in bad[1].problem
    assert "lone surrogate" in bad[2].problem


def test_storable_keys_give_nothing() -> None:
    assert unstorable_keys(["item:1", "é:2"]) == []


def test_the_message_names_the_first_key_by_itself_and_counts_the_others() -> None:
    bad = unstorable_keys(KEYS)
    assert unstorable_message(bad, undone="touched", first="key") == (
        "key 'item:\\x00' cannot be stored: it contains a NUL character (at index 5) "
        "(and 2 more); nothing was touched")


def test_the_message_of_one_key_counts_no_others() -> None:
    one = [Unstorable(index=0, key="k", problem="it is odd")]
    assert unstorable_message(one, undone="touched", first="key") == (
        "key 'k' cannot be stored: it is odd; nothing was touched")


def test_the_message_names_the_first_key_by_its_index_or_not_at_all() -> None:
    bad = unstorable_keys(KEYS)
    assert unstorable_message(bad, undone="touched", first="index") == (
        "3 keys cannot be stored (keys[1]: it contains a NUL character (at index 5)); "
        "nothing was touched")
    assert unstorable_message(bad[:1], undone="retried", first="none") == (
        "1 key cannot be stored; nothing was retried")
