"""JSON read with a bound on its nesting: a deeper text is refused (naming the depth
and where it is passed) before it is decoded, by one pass over its brackets that stops
at the first level too deep."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from coalescer.common import json_depth
from coalescer.common.json_depth import MAX_DEPTH, TooDeep, depth_passed, loads_bounded


def nested(levels: int, *, text: bool = True) -> Any:
    raw = "[" * levels + "]" * levels
    return raw if text else raw.encode()


@pytest.mark.parametrize("as_text", [True, False])
def test_json_at_the_bound_is_read(as_text: bool) -> None:
    assert loads_bounded(nested(MAX_DEPTH, text=as_text)) == json.loads(nested(MAX_DEPTH))
    assert loads_bounded('{"a": {"b": [1, 2, {"c": "x"}]}}') == {"a": {"b": [1, 2,
                                                                               {"c": "x"}]}}


@pytest.mark.parametrize("as_text", [True, False])
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 10_000, 500_000])
def test_json_past_the_bound_is_refused_before_it_is_decoded(
        monkeypatch: pytest.MonkeyPatch, levels: int, as_text: bool) -> None:
    decoded: list[Any] = []
    monkeypatch.setattr(json_depth.json, "loads", lambda *a, **k: decoded.append(a))
    with pytest.raises(TooDeep) as info:
        loads_bounded(nested(levels, text=as_text))
    assert str(info.value) == f"more than {MAX_DEPTH} levels deep (at offset {MAX_DEPTH})"
    assert decoded == []


class CountingBrackets:
    """The bracket pattern, counting the brackets the depth pass looks at."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.seen = 0

    def finditer(self, text: str) -> Any:
        for match in self.pattern.finditer(text):
            self.seen += 1
            yield match


@pytest.mark.parametrize("levels", [1_000, 10_000, 100_000])
def test_the_depth_pass_stops_at_the_first_level_too_deep(
        monkeypatch: pytest.MonkeyPatch, levels: int) -> None:
    counting = CountingBrackets(json_depth._BRACKET)
    monkeypatch.setattr(json_depth, "_BRACKET", counting)
    assert depth_passed(nested(levels)) == MAX_DEPTH
    assert counting.seen == MAX_DEPTH + 1  # the same work at 1,000 levels and 100,000


@pytest.mark.parametrize("pairs", [100, 1_000, 10_000])
def test_many_shallow_brackets_cost_one_look_each(monkeypatch: pytest.MonkeyPatch,
                                                  pairs: int) -> None:
    counting = CountingBrackets(json_depth._BRACKET)
    monkeypatch.setattr(json_depth, "_BRACKET", counting)
    text = "[" + ",".join(["[]"] * pairs) + "]"
    assert depth_passed(text) is None
    assert counting.seen == 2 * pairs + 2  # linear in the size


def test_brackets_inside_strings_do_not_nest() -> None:
    text = json.dumps({"a": "[" * 1000, "b": "{\\\"[" * 100, "c": [[1]]})
    assert depth_passed(text) is None
    assert loads_bounded(text)["c"] == [[1]]
    assert depth_passed(json.dumps(["[" * 100, nested(MAX_DEPTH)])) is None


def test_bad_json_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        loads_bounded("{")
