"""A rule's ``fair:`` and ``priority:``: how they are written (in a file and in code),
what ``check -v`` shows, and every way they are refused (file, line and field)."""

from __future__ import annotations

import re
from pathlib import Path
from textwrap import dedent

import pytest

from coalescer import Rule, Rules
from coalescer.config.fair import lua_pattern
from coalescer.config.patterns import KeyPattern
from coalescer.config.rules import Config
from coalescer.errors import ConfigError


def _rules(tmp_path: Path, *fields: str, match: str = "t:{org}:{id}") -> Path:
    """Two rules; the second's last lines are ``fields`` (line 8 is the first of them)."""
    path = tmp_path / "rules.yaml"
    path.write_text(dedent(f"""\
        rules:
          - name: plain
            match: "plain:*"
            handler: json:dumps
          - name: tenants
            match: "{match}"
            handler: json:dumps
        """) + "".join(f"    {field}\n" for field in fields))
    return path


def test_fair_and_priority_are_read_with_their_defaults(tmp_path: Path) -> None:
    path = _rules(tmp_path, 'fair: {by: "{org}", weights: {acme: 3, small: 0.5}, '
                            'max_running: 4}', "priority: 2s")
    config = Config.from_yaml(path)
    assert config.rule("plain").fair is None and config.rule("plain").priority is None
    rule = config.rule("tenants")
    assert rule.fair is not None
    assert (rule.fair.by, dict(rule.fair.weights), rule.fair.max_running) == (
        "org", {"acme": 3.0, "small": 0.5}, 4)
    assert rule.fair.weight("acme") == 3.0 and rule.fair.weight("other") == 1.0
    assert rule.priority == 2.0
    described = config.describe()
    assert "fair: by {org}" in described and "weights acme=3, small=0.5 (others 1)" in described
    assert "max_running 4 per group, cluster-wide" in described
    assert "priority: 2s" in described


def test_by_may_be_written_with_or_without_braces(tmp_path: Path) -> None:
    rule = Config.from_yaml(_rules(tmp_path, "fair: {by: org}")).rule("tenants")
    assert rule.fair is not None and rule.fair.by == "org"
    assert rule.fair.weights == {} and rule.fair.max_running is None


@pytest.mark.parametrize(("fair", "field", "fragment"), [
    ('fair: {by: "{tenant}"}', "rules[1].fair.by",
     "not a capture of the rule's pattern 't:{org}:{id}' (its captures: {org}, {id})"),
    ("fair: {weights: {a: 2}}", "rules[1].fair.by", "missing the required field 'by'"),
    ('fair: {by: org, weights: {a: 0}}', "rules[1].fair.weights.a",
     "a weight must be a number above 0"),
    ('fair: {by: org, weights: {a: -1}}', "rules[1].fair.weights.a", "got -1"),
    ('fair: {by: org, weights: {a: "x"}}', "rules[1].fair.weights.a", "got 'x'"),
    ('fair: {by: org, weights: {a: .nan}}', "rules[1].fair.weights.a", "got nan"),
    ('fair: {by: org, weights: [a]}', "rules[1].fair.weights", "must be a mapping"),
    ('fair: {by: org, max_running: 0}', "rules[1].fair.max_running", "positive whole"),
    ('fair: {by: org, max_running: 1.5}', "rules[1].fair.max_running", "got 1.5"),
    ('fair: {by: org, max: 3}', "rules[1].fair.max", "unknown field 'max' in fair"),
    ("fair: org", "rules[1].fair", "fair must be a mapping"),
    ("priority: -1s", "rules[1].priority", "negative duration"),
    ("priority: soon", "rules[1].priority", "bad duration"),
    ("priority: 400d", "rules[1].priority", "at most a year and a day"),
])
def test_a_bad_fair_or_priority_is_refused_with_file_line_and_field(
        tmp_path: Path, fair: str, field: str, fragment: str) -> None:
    path = _rules(tmp_path, fair)
    with pytest.raises(ConfigError) as info:
        Config.from_yaml(path)
    error = info.value
    assert (error.file, error.line, error.field) == (str(path), 8, field), error
    assert fragment in error.message, error.message


def test_a_fair_rule_pattern_holds_at_most_one_wildcard(tmp_path: Path) -> None:
    path = _rules(tmp_path, "fair: {by: org}", match="t:*:{org}:*")
    with pytest.raises(ConfigError, match=r"at most one '\*'") as info:
        Config.from_yaml(path)
    assert info.value.field == "rules[1].fair.by"


def test_rules_in_code_take_fair_and_priority() -> None:
    config = Rules(rules=[Rule(name="tenants", match="t:{org}:{id}", handler="json:dumps",
                               fair={"by": "{org}", "max_running": 2}, priority="1s")]).config
    rule = config.rule("tenants")
    assert rule.fair is not None and rule.fair.max_running == 2 and rule.priority == 1.0
    with pytest.raises(ConfigError, match="not a capture") as info:
        Rules(rules=[Rule(name="x", match="x:{id}", handler="json:dumps",
                          fair={"by": "org"})])
    assert info.value.field == "rules[0].fair.by"


@pytest.mark.parametrize(("pattern", "key", "group"), [
    ("t:{org}:{id}", "t:acme:7", "acme"),
    ("t.{org}:*", "t.a-b(c)%:x:y", "a-b(c)%"),
    ("*:{org}", "x:y:z", "z"),
    ("[{org}]+{id}", "[a]+b", "a"),
])
def test_the_claim_scripts_group_pattern_reads_the_capture(pattern: str, key: str,
                                                           group: str) -> None:
    compiled = KeyPattern.compile(pattern)
    assert compiled.match(key) is not None
    lua = lua_pattern(compiled, "org")
    # Lua's %X escapes a magic character as Python's \X does
    assert re.fullmatch(lua[1:-1].replace("%", "\\").replace(".*", ".*"), key)
    assert re.fullmatch(lua[1:-1].replace("%", "\\"), key).group(1) == group  # type: ignore[union-attr]


def test_a_fair_rule_is_hashable_as_every_rule_is(tmp_path: Path) -> None:
    path = _rules(tmp_path, 'fair: {by: "{org}", weights: {acme: 3}}')
    rule = Config.from_yaml(path).rule("tenants")
    assert {rule: 1}[rule] == 1  # the runner keys its results by rule
