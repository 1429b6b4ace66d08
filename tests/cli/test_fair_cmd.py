"""`coalescer fair RULE` against a real valkey-server: as a real child process it shows a
fair rule's weights and cap, changes them at runtime (every shard's copy) and resets
them; it refuses what it cannot do with one line naming why (run in this process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coalescer.cli.main import main
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


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(ns=namespace))
    return path


def _namespace(rules: Path) -> str:
    return rules.read_text().split("\n", 1)[0].removeprefix("namespace: ")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``coalescer ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's refusal
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_fair_shows_changes_and_resets_a_rules_weights_and_cap(
        rules: Path, namespace: str, redis_url: str, r: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--rules", str(rules), "--redis", redis_url)
    code, shown, _ = run(capsys, "fair", "tenants", *common)
    assert code == 0
    assert "fair by {org}" in shown and "weights: acme=2 (others 1)" in shown
    assert "max_running: none" in shown

    changed = cli("fair", "tenants", "--weight", "small=0.5", "--weight", "acme=4",
                  "--max-running", "3", "--json", *common, cwd=rules.parent)
    assert changed.returncode == 0, changed.stderr  # a real child process
    view = json.loads(changed.stdout)
    assert view["weights"] == {"acme": 4.0, "small": 0.5} and view["max_running"] == 3
    for shard in KeySpace(namespace, 2).all_shards():
        assert r.hgetall(shard.fair("tenants") + "conf") == {
            "w:acme": "4.0", "w:small": "0.5", "cap": "3"}
    assert "acme=4 (runtime)" in run(capsys, "fair", "tenants", *common)[1]

    code, reset, _ = run(capsys, "fair", "tenants", "--reset", "--json", *common)
    assert code == 0 and json.loads(reset)["weights"] == {"acme": 2.0}
    assert json.loads(reset)["max_running"] is None


@pytest.mark.parametrize("case", [
    (("plain", "--weight", "a=2"), 1, "rule 'plain' has no fair:"),
    (("nope",), 1, "no rule named 'nope'"),
    (("tenants", "--weight", "a=0"), 1, "weight for 'a': a weight must be a number above 0"),
    (("tenants", "--weight", "a"), 2, "VALUE=WEIGHT (acme=3), got 'a'"),
    (("tenants", "--max-running", "0"), 2, "a whole number from 1, got '0'"),
    (("tenants", "--max-running", "2", "--no-cap"), 2, "not allowed with argument"),
])
def test_fair_refuses_with_one_line_naming_why(
        rules: Path, redis_url: str, r: redis.Redis, capsys: pytest.CaptureFixture[str],
        case: tuple[tuple[str, ...], int, str]) -> None:
    args, code, fragment = case
    namespace = _namespace(rules)
    done, _, err = run(capsys, "fair", *args, "--rules", str(rules), "--redis", redis_url)
    assert done == code and fragment in err, err
    assert not any(r.exists(s.fair("tenants") + "conf")
                   for s in KeySpace(namespace, 2).all_shards())
