"""Key matching is linear in the key's length for every pattern, and answers as the
regular expressions it replaced did (the first rule that matches wins, same captures)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from coalescer.config.matcher import Work
from coalescer.config.patterns import _TOKEN_RE, KeyPattern
from coalescer.config.rules import Config
from coalescer.errors import InvalidKeyError, UnknownKeyError


def regex_of(source: str) -> str:
    """The backtracking regular expression a pattern used to compile to (kept here only,
    to compare answers with)."""
    parts: list[str] = []
    for token in _TOKEN_RE.findall(source):
        if token.startswith("*"):
            parts.append("[^\x00]*")
        elif token.startswith("{"):
            parts.append(f"(?P<{token[1:-1]}>[^:\x00]+)")
        else:
            parts.append(re.escape(token))
    return "".join(parts)


def random_pattern(rng: random.Random) -> str:
    pieces = []
    for number in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.3:
            pieces.append("*")
        elif kind < 0.55:
            pieces.append(f"{{c{number}}}")
        else:
            pieces.append("".join(rng.choice("ab:") for _ in range(rng.randint(1, 3))))
    return "".join(pieces)


def random_key(rng: random.Random) -> str:
    return "".join(rng.choice("ab:\x00") if rng.random() < 0.05 else rng.choice("ab:")
                   for _ in range(rng.randint(0, 12)))


def test_random_patterns_and_keys_match_as_the_regular_expressions_did() -> None:
    rng = random.Random(20261205)
    compared = matched = 0
    for _ in range(600):
        source = random_pattern(rng)
        pattern, old = KeyPattern.compile(source), re.compile(regex_of(source), re.DOTALL)
        for _ in range(30):
            key = random_key(rng)
            found = old.fullmatch(key)
            assert pattern.match(key) == (None if found is None else found.groupdict()), (
                source, key)
            compared += 1
            matched += found is not None
    assert matched > compared // 10  # the keys do exercise matches, captures included


def test_random_rules_files_pick_the_rule_the_combined_expression_picked() -> None:
    rng = random.Random(7)
    for _ in range(150):
        sources = [random_pattern(rng) for _ in range(rng.randint(1, 6))]
        rules = "\n".join(f'- {{name: r{n}, match: "{s}", handler: m:f}}'
                          for n, s in enumerate(sources))
        config = Config.from_string(f"namespace: t\nrules:\n{rules}\n", import_handlers=False)
        for _ in range(30):
            key = random_key(rng)
            first = next((n for n, s in enumerate(sources)
                          if re.fullmatch(regex_of(s), key, re.DOTALL)), None)
            if first is None:
                assert key_unmatched(config, key)
            else:
                rule, params = config.match(key)
                expected = re.fullmatch(regex_of(sources[first]), key, re.DOTALL)
                assert expected is not None
                assert (rule.name, params) == (f"r{first}", expected.groupdict())


def key_unmatched(config: Config, key: str) -> bool:
    try:
        config.match(key)
    except LookupError:
        return True
    return False


ATTACKS = ["report:*:*:*:done", "report:*:*:*:*:*:*:done", "{a}{b}{c}{d}:x",
           "*{a}*{b}*{c}*!", "*:*:*:*:*:*:*:*"]


@pytest.mark.parametrize("source", ATTACKS)
def test_a_key_of_colons_costs_steps_in_proportion_to_its_length(source: str) -> None:
    # report:*:*:*:done took 6.2 s on a 1 KiB key of colons with a backtracking regex
    # (its steps grow with the cube of the key's length); here they grow linearly.
    pattern = KeyPattern.compile(source)
    costs = []
    for size in (1024, 2048, 4096):
        work = Work()
        for key in ("report:" + ":" * size, "a" * size, ":" * size):
            pattern.match(key, work)
        costs.append(work.steps)
    tokens = len(pattern.matcher.tokens)
    assert costs[0] <= 3 * (1024 + 8) * tokens + 64
    assert costs[2] <= 4 * costs[0] + 64 <= 4 * costs[1] + 128


def test_the_attack_key_is_answered_by_a_rules_file_of_many_wildcard_rules() -> None:
    rules = "\n".join(f'- {{name: r{n}, match: "{s}", handler: m:f}}'
                      for n, s in enumerate(ATTACKS))
    config = Config.from_string(f"namespace: t\nrules:\n{rules}\n", import_handlers=False)
    key = "report:" + ":" * 1017
    assert config.rule_for(key).name == "r4"  # *:*:*... matches 7 colons or more
    with pytest.raises(LookupError):  # a backtracking expression took hours on this one
        config.rule_for("report" + "x" * 1018)


def test_a_key_over_the_length_limit_is_refused_before_any_rule_is_tried() -> None:
    config = Config.from_string('namespace: t\nrules:\n- {name: all, match: "*", handler: m:f}\n',
                                import_handlers=False)
    assert config.rule_for("k" * 1024).name == "all"
    for key in ("k" * 1025, ":" * (1 << 20)):
        with pytest.raises(InvalidKeyError, match="over the limit of 1024 bytes"):
            config.match(key)
        with pytest.raises(InvalidKeyError):
            config.rule_for(key)


class CountedKey(str):
    """A key that counts how often its characters are read one by one."""

    reads = 0

    def __getitem__(self, index: Any) -> str:
        CountedKey.reads += 1
        return str.__getitem__(self, index)


def test_the_closest_rule_of_a_long_unknown_key_is_found_from_its_start_only() -> None:
    # the message of an unknown 1 KiB key compared every character with 10,000 rules
    # (6.8 s); it compares its first 200 characters
    near = [(f"t{n}:orders:", f"rule r{n}") for n in range(1000)]
    key = CountedKey("t17:orders:" + "9" * (1 << 16))
    error = UnknownKeyError(key, near=near)
    assert error.closest() is None  # not alike enough over 200 characters
    assert CountedKey.reads <= 1
    assert UnknownKeyError("t17:orders:", near=near).closest() == "rule r17"


@pytest.mark.parametrize(("source", "fast"), [
    ("stats:user:{id}", True), ("report:{a}:{b}:done", True), ("{a}:{b}", True),
    ("x:{a}-{b}", False), ("{a}{b}", False), ("orders:*", False), ("a:{id}b", False)])
def test_common_patterns_match_in_one_pass_of_a_regular_expression(source: str,
                                                                   fast: bool) -> None:
    assert (KeyPattern.compile(source).matcher.fast is not None) is fast


def test_the_one_pass_expression_answers_as_the_step_by_step_matcher() -> None:
    rng = random.Random(5)
    compared = 0
    for _ in range(2000):
        pattern = KeyPattern.compile(random_pattern(rng))
        if pattern.matcher.fast is None:
            continue
        for _ in range(30):
            key = random_key(rng)
            assert pattern.match(key) == pattern.match(key, Work()), (pattern.source, key)
            compared += 1
    assert compared > 3000
