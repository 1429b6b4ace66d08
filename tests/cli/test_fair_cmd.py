"""`coalescer fair RULE`, run as a real child process against a real valkey-server: shows
a fair rule's weights and cap, changes them at runtime (every shard's copy), resets them,
and refuses what it cannot do with one line naming why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coalescer.store.keys import KeySpace
from tests.cli.test_main import cli

RULES = """\
namespace: {ns}
shards: 2
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    handler: {{http: {{url: "http://127.0.0.1:9/"}}}}
    fair: {{by: "{{org}}", weights: {{acme: 2}}}}
  - name: plain
    match: "p:{{id}}"
    handler: {{http: {{url: "http://127.0.0.1:9/"}}}}
"""


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_fair_shows_changes_and_resets_a_rules_weights_and_cap(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace))
    common = ("--rules", str(rules), "--redis", redis_url)

    shown = cli("fair", "tenants", *common, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "fair by {org}" in shown.stdout and "weights: acme=2 (others 1)" in shown.stdout
    assert "max_running: none" in shown.stdout

    changed = cli("fair", "tenants", "--weight", "small=0.5", "--weight", "acme=4",
                  "--max-running", "3", "--json", *common, cwd=tmp_path)
    assert changed.returncode == 0, changed.stderr
    view = json.loads(changed.stdout)
    assert view["weights"] == {"acme": 4.0, "small": 0.5} and view["max_running"] == 3
    for shard in KeySpace(namespace, 2).all_shards():
        assert r.hgetall(shard.fair("tenants") + "conf") == {
            "w:acme": "4.0", "w:small": "0.5", "cap": "3"}
    assert "acme=4 (runtime)" in cli("fair", "tenants", *common, cwd=tmp_path).stdout

    reset = cli("fair", "tenants", "--reset", "--json", *common, cwd=tmp_path)
    assert json.loads(reset.stdout)["weights"] == {"acme": 2.0}
    assert json.loads(reset.stdout)["max_running"] is None


@pytest.mark.parametrize("case", [
    (("plain", "--weight", "a=2"), 1, "rule 'plain' has no fair:"),
    (("nope",), 1, "no rule named 'nope'"),
    (("tenants", "--weight", "a=0"), 1, "weight for 'a': a weight must be a number above 0"),
    (("tenants", "--weight", "a"), 2, "VALUE=WEIGHT (acme=3), got 'a'"),
    (("tenants", "--max-running", "0"), 2, "a whole number from 1, got '0'"),
    (("tenants", "--max-running", "2", "--no-cap"), 2, "not allowed with argument"),
])
def test_fair_refuses_with_one_line_naming_why(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis,
        case: tuple[tuple[str, ...], int, str]) -> None:
    args, code, fragment = case
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace))
    done = cli("fair", *args, "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == code and fragment in done.stderr, done.stderr
    assert not any(r.exists(s.fair("tenants") + "conf")
                   for s in KeySpace(namespace, 2).all_shards())
