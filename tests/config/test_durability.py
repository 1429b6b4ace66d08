"""The top-level ``durability:`` field: how it is written, and every way it is refused."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from coalescer.config.durability import Durability
from coalescer.config.rules import Config
from coalescer.errors import ConfigError


def _rules(tmp_path: Path, durability: str | None) -> Path:
    path = tmp_path / "rules.yaml"
    field = f"durability: {durability}\n" if durability is not None else ""
    path.write_text(dedent("""\
        namespace: app
        {field}rules:
          - name: plain
            match: "plain:*"
            handler: json:dumps
        """).replace("{field}", field))
    return path


@pytest.mark.parametrize(("text", "expected"), [
    (None, Durability(replicas=0, timeout=1.0)),
    ("{replicas: 1}", Durability(replicas=1, timeout=1.0)),
    ("{replicas: 2, timeout: 250ms}", Durability(replicas=2, timeout=0.25)),
    ("{replicas: 0, timeout: 5s}", Durability(replicas=0, timeout=5.0)),
    ("{}", Durability(replicas=0, timeout=1.0)),
])
def test_durability_names_the_replicas_each_write_waits_for(
        tmp_path: Path, text: str | None, expected: Durability) -> None:
    assert Config.from_yaml(_rules(tmp_path, text)).durability == expected


@pytest.mark.parametrize(("text", "field", "fragment"), [
    ("{replicas: -1}", "durability.replicas", "from 0 (no waiting) to 16"),
    ("{replicas: 17}", "durability.replicas", "got 17"),
    ("{replicas: one}", "durability.replicas", "got 'one'"),
    ("{replicas: true}", "durability.replicas", "got True"),
    ("{replicas: 1, timeout: 0s}", "durability.timeout", "must be longer than 0"),
    ("{replicas: 1, timeout: 6s}", "durability.timeout", "must be at most 5s"),
    ("{replicas: 1, timeout: soon}", "durability.timeout", "bad duration 'soon'"),
    ("{replicas: 1, timeout: 2s}", "durability.timeout",
     "at most a quarter of claim_lease (5s): a claim waits for its replicas"),
    ("{replica: 1}", "durability.replica", "did you mean 'replicas'?"),
    ("1", "durability", "durability must be a mapping"),
])
def test_a_bad_durability_is_refused_with_file_line_and_field(
        tmp_path: Path, text: str, field: str, fragment: str) -> None:
    path = _rules(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    error = info.value
    assert (error.file, error.line, error.field) == (str(path), 2, field)
    assert fragment in error.message, error.message
