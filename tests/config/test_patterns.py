"""KeyPattern: {name} captures, * wildcards, literal text."""

from __future__ import annotations

import pytest

from coalescer.config.patterns import KeyPattern


def test_literal_pattern_matches_only_itself() -> None:
    pattern = KeyPattern.compile("stats:global")
    assert pattern.match("stats:global") == {}
    assert pattern.match("stats:global:x") is None
    assert pattern.match("xstats:global") is None
    assert pattern.names == ()
    assert pattern.source == "stats:global"


def test_capture_takes_one_segment() -> None:
    pattern = KeyPattern.compile("stats:user:{user_id}")
    assert pattern.names == ("user_id",)
    assert pattern.match("stats:user:42") == {"user_id": "42"}
    assert pattern.match("stats:user:4 2/x") == {"user_id": "4 2/x"}
    assert pattern.match("stats:user:42:extra") is None
    assert pattern.match("stats:user:") is None


def test_several_captures() -> None:
    pattern = KeyPattern.compile("doc:{tenant}:{doc_id}.json")
    assert pattern.names == ("tenant", "doc_id")
    assert pattern.match("doc:acme:7.json") == {"tenant": "acme", "doc_id": "7"}
    assert pattern.match("doc:acme:7.xml") is None


def test_captures_may_take_any_identifier_as_name() -> None:
    pattern = KeyPattern.compile("{class}:{été}:{_x1}")
    assert pattern.match("a:b:c") == {"class": "a", "été": "b", "_x1": "c"}


def test_star_matches_anything_including_colons_and_nothing() -> None:
    pattern = KeyPattern.compile("cache:*")
    assert pattern.match("cache:a:b:c") == {}
    assert pattern.match("cache:") == {}
    assert pattern.match("cach") is None
    everything = KeyPattern.compile("*")
    assert everything.match("") == {}
    assert everything.match("any:thing\nat all") == {}


def test_star_and_capture_together() -> None:
    pattern = KeyPattern.compile("*:user:{user_id}")
    assert pattern.match("a:b:user:9") == {"user_id": "9"}
    assert pattern.match("user:9") is None


def test_other_characters_are_literal() -> None:
    pattern = KeyPattern.compile("a.b+c?(d)[e]|f$^\\")
    assert pattern.match("a.b+c?(d)[e]|f$^\\") == {}
    assert pattern.match("axbbc(d)[e]|f$^\\") is None


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("", "empty pattern"),
        ("stats:{", "unbalanced '{'"),
        ("stats:}", "unbalanced '}'"),
        ("stats:{user", "unbalanced '{'"),
        ("stats:user}", "unbalanced '}'"),
        ("stats:{{user}}", "unbalanced"),
        ("stats:{}", "empty braces"),
        ("stats:{1user}", "not an identifier"),
        ("stats:{user-id}", "not an identifier"),
        ("stats:{ id }", "not an identifier"),
        ("{a}:{a}", "appears twice"),
    ],
)
def test_refusals(source: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        KeyPattern.compile(source)
    message = str(info.value)
    assert fragment in message
    assert "{name}" in message  # says what is allowed


def test_pattern_is_frozen() -> None:
    pattern = KeyPattern.compile("a")
    with pytest.raises(AttributeError):
        pattern.source = "b"  # type: ignore[misc]


def test_no_pattern_matches_a_key_holding_a_nul() -> None:
    # NUL separates keys in the upsert script's argument, so such a key matches no rule.
    assert KeyPattern.compile("*").match("a\x00b") is None
    assert KeyPattern.compile("k:{id}").match("k:a\x00b") is None
    assert KeyPattern.compile("*").match("a|b c") == {}
