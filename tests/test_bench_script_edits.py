"""Scripts edited for a measurement (bench/script_edits.py): a client made inside the
block registers the edited text, and the scripts are the process's own again after it,
even when the block fails."""

from __future__ import annotations

import pytest

from bench.script_edits import edited_scripts
from coalescer.store import script_calls

ORIGINAL = script_calls.script_source


def tagged(name: str, source: str) -> str:
    return f"-- edited {name}\n{source}"


def test_inside_the_block_each_script_reads_as_edited() -> None:
    with edited_scripts(tagged):
        assert script_calls.script_source("ack") == tagged("ack", ORIGINAL("ack"))

    assert script_calls.script_source is ORIGINAL


def test_a_block_that_fails_leaves_the_scripts_as_they_were() -> None:
    with pytest.raises(RuntimeError, match="measurement failed"), edited_scripts(tagged):
        raise RuntimeError("measurement failed")

    assert script_calls.script_source is ORIGINAL
