"""The ``edge`` field: ``trailing`` (the default) or ``leading``, on a rule, in
``defaults`` and in rules in code; shown by ``check -v`` and ``explain``; anything else
refused with the file, line and field."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from coalescer.cli.main import main
from coalescer.config.code_rules import Rule, Rules
from coalescer.config.rules import Config
from coalescer.errors import ConfigError

RULES = """\
defaults:
  edge: {default}
rules:
  - name: a
    match: "a:{{id}}"
    handler: {{http: {{url: "http://127.0.0.1:9/a"}}}}
  - name: b
    match: "b:{{id}}"
    edge: {edge}
    handler: {{http: {{url: "http://127.0.0.1:9/b"}}}}
"""


def write(tmp_path: Path, default: str = "trailing", edge: str = "leading") -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(dedent(RULES.format(default=default, edge=edge)))
    return path


def test_trailing_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - {name: a, match: 'a:*', handler: {http: {url: "
                    "'http://127.0.0.1:9/a'}}}\n")
    rule = Config.from_yaml(path).rules[0]
    assert (rule.edge, rule.leading) == ("trailing", False)


def test_a_rule_says_its_edge_and_defaults_give_the_others_theirs(tmp_path: Path) -> None:
    rules = Config.from_yaml(write(tmp_path, default="leading", edge="trailing")).rules
    assert [r.edge for r in rules] == ["leading", "trailing"]
    rules = Config.from_yaml(write(tmp_path)).rules
    assert [r.edge for r in rules] == ["trailing", "leading"]


def test_an_unknown_edge_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, edge="sideways")
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    error = info.value
    assert (error.file, error.line, error.field) == (str(path), 9, "rules[1].edge")
    assert "edge must be trailing or leading, got 'sideways'" in str(error)


def test_an_unknown_edge_in_defaults_names_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, default="both")
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    assert (info.value.line, info.value.field) == (2, "defaults.edge")


def test_rules_in_code_take_an_edge_and_refuse_a_bad_one() -> None:
    rules = Rules(defaults={"edge": "leading"}, rules=[
        Rule(name="a", match="a:*", handler="m:f"),
        Rule(name="b", match="b:*", handler="m:f", edge="trailing")])
    assert [r.edge for r in rules.config.rules] == ["leading", "trailing"]
    with pytest.raises(ConfigError) as info:
        Rules(rules=[Rule(name="a", match="a:*", handler="m:f", edge=True)])  # type: ignore[arg-type]
    assert info.value.field == "rules[0].edge"
    assert info.value.file == __file__


def test_check_v_shows_a_leading_rule(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "-v", str(write(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out.count("edge: leading") == 1
    assert "edge: leading" in out.split("b  (line")[1]
