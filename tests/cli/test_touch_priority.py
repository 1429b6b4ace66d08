"""``coalescer touch KEY... --priority DURATION`` in a real process, on a real server:
the keys keep their priority; a bad one touches nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from tests.cli.test_main import cli, r
from tests.helpers.e2e import line_rules

__all__ = ["r"]  # the fixture, used by name

RULES = """\
namespace: {ns}
defaults:
  window: 100ms
  absorb: 10ms
rules:
  - name: job
    match: "job:{{id}}"
    priority: 0s
    handler: {{mod}}:refresh
  - name: plain
    match: "plain:{{id}}"
    handler: {{mod}}:refresh
"""


def priority_ms(client: redis.Redis, namespace: str, key: str) -> int | None:
    value = client.hget(KeySpace(namespace, 1).shard(0).meta, key)
    found = None if value is None else states.pending(str(value))
    return None if found is None else found.priority_ms


def test_touch_with_a_priority_keeps_it_with_the_keys(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = line_rules(tmp_path, f"cli_{namespace}", RULES.format(ns=namespace))
    done = cli("touch", "job:1", "job:2", "--priority", "30s", "--rules", str(rules),
               "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "touched 2 keys"
    assert [priority_ms(r, namespace, k) for k in ("job:1", "job:2")] == [30_000, 30_000]


@pytest.mark.parametrize(("args", "says"), [
    (("job:1", "--priority=-5s"), "--priority '-5s' for key 'job:1': negative"),
    (("job:1", "plain:1", "--priority", "1s"),
     "--priority '1s' for key 'plain:1': rule 'plain' orders its due keys by due time only"),
])
def test_touch_with_a_bad_priority_exits_2_and_touches_nothing(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis,
        *, args: tuple[str, ...], says: str) -> None:
    rules = line_rules(tmp_path, f"cli_{namespace}", RULES.format(ns=namespace))
    done = cli("touch", *args, "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr and "nothing was touched" in done.stderr
    assert r.keys(f"{namespace}:*") == []
