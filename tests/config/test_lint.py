"""The unreachable-rule lint compares a rule only with the earlier rules that may share a
key with it; its warnings are the same as comparing it with every earlier rule."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from coalescer.config.lint import ConfigWarning, RuleMatch, unreachable
from coalescer.config.patterns import KeyPattern, covers


def pairwise_oracle(file: str, matches: Sequence[RuleMatch]) -> list[ConfigWarning]:
    """The lint as it was: every rule against every rule listed before it."""
    found: list[ConfigWarning] = []
    for position, rule in enumerate(matches):
        earlier = matches[:position]
        culprit = next((e for e in earlier if covers([e.pattern], rule.pattern)), None)
        if culprit is not None:
            by = f"{culprit}, listed before it"
        elif len(earlier) > 1 and covers([e.pattern for e in earlier], rule.pattern):
            by = "the rules listed before it, between them"
        else:
            continue
        found.append(ConfigWarning(
            f"rule {rule.name!r} can never match: every key its pattern "
            f"{rule.pattern.source!r} matches is matched first by {by} (the first match "
            "wins); move it up or remove it", file, rule.line, f"rules[{rule.index}].match"))
    return found


_PIECES = ["a", "b", ":", "a:", "b:", "ab", "{x}", "{y}", "*"]


def random_pattern(rng: random.Random) -> str:
    while True:
        pieces = [rng.choice(_PIECES) for _ in range(rng.randint(1, 4))]
        names = [p for p in pieces if p.startswith("{")]
        if len(names) == len(set(names)):
            return "".join(pieces)


def random_rules(rng: random.Random, count: int) -> list[RuleMatch]:
    return [RuleMatch(index=i, name=f"r{i}", pattern=KeyPattern.compile(random_pattern(rng)),
                      line=3 + 3 * i) for i in range(count)]


@pytest.mark.parametrize("seed", range(200))
def test_warnings_are_those_of_comparing_every_earlier_rule(seed: int) -> None:
    rng = random.Random(seed)
    rules = random_rules(rng, rng.randint(1, 12))
    assert unreachable("rules.yaml", rules) == pairwise_oracle("rules.yaml", rules)


def test_the_random_rule_sets_do_produce_warnings_of_both_kinds() -> None:
    """The comparison above is not vacuous: its rule sets warn."""
    messages = [w.message for seed in range(200)
                for w in pairwise_oracle("f", random_rules(random.Random(seed),
                                                           random.Random(seed).randint(1, 12)))]
    assert sum("', line " in m for m in messages) > 20


def test_many_rules_with_literal_prefixes_warn_as_before() -> None:
    patterns = [f"t{i}:{{id}}" for i in range(300)] + ["t7:*", "t12:x", "t3*", "{a}:{b}",
                                                    "x:", "x:{a}", "x:*:*", "x:*"]
    rules = [RuleMatch(index=i, name=f"r{i}", pattern=KeyPattern.compile(p), line=i + 1)
             for i, p in enumerate(patterns)]
    found = unreachable("f", rules)
    assert found == pairwise_oracle("f", rules)
    assert [w.field for w in found] == ["rules[301].match", "rules[305].match",
                                       "rules[307].match"]
    assert "between them" in found[2].message
