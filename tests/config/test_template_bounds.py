"""Filling a source's template is bounded: its length is summed before the text is
made, and a text longer than the longest key is refused, naming the field."""

from __future__ import annotations

import pytest

from coalescer.config.templates import MAX_FILLED, KeyTemplate, TemplateOverflow


def test_a_filling_within_the_bound_is_made() -> None:
    template = KeyTemplate.compile("order:{id}:{part}")
    assert template.fill({"id": "7", "part": "x" * (MAX_FILLED - 8)}).startswith("order:7:x")


@pytest.mark.parametrize("size", [MAX_FILLED, 10 * MAX_FILLED, 1 << 20])
def test_a_filling_past_the_bound_is_refused_before_it_is_made(size: int) -> None:
    template = KeyTemplate.compile("order:{id}:{part}")
    with pytest.raises(TemplateOverflow) as info:
        template.fill({"id": "7", "part": "x" * size})
    message = str(info.value)
    assert f"would make {size + 8} characters, over the limit of {MAX_FILLED}" in message
    assert f"field 'part' holds {size}" in message
    assert len(message) < 300


def test_a_long_literal_template_names_no_field() -> None:
    with pytest.raises(TemplateOverflow) as info:
        KeyTemplate.compile("k" * (MAX_FILLED + 1)).fill({})
    assert "field" not in str(info.value)
