"""``coalescer touch KEY... --at ISO-8601 | --delay DURATION`` in a real process, on a
real server: the keys are due at that time; a bad time touches nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from coalescer.store import key_states as states
from coalescer.store.keys import KeySpace
from tests.cli.test_main import cli, r, write_rules

__all__ = ["r"]  # the fixture, used by name


def pending(client: redis.Redis, namespace: str, key: str) -> states.Pending | None:
    value = client.hget(KeySpace(namespace, 1).shard(0).meta, key)
    return None if value is None else states.pending(str(value))


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_touch_at_and_delay_make_the_keys_due_then(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace)
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(days=30)
    done = cli("touch", "item:1", "other:a", "--at", when.isoformat(), "--rules", str(rules),
               "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"touched 2 keys, due at {when.isoformat()}"
    for key in ("item:1", "other:a"):
        found = pending(r, namespace, key)
        assert found is not None and found.due_ms == int(when.timestamp()) * 1000

    before = server_ms(r)
    done = cli("touch", "item:2", "--delay", "30m", "--rules", str(rules), "--redis",
               redis_url, cwd=tmp_path)
    after = server_ms(r)
    assert done.returncode == 0, done.stderr
    found = pending(r, namespace, "item:2")
    assert found is not None and before + 1_800_000 <= found.due_ms <= after + 1_800_000


@pytest.mark.parametrize(("args", "says"), [
    (("--at", "2030-01-01T12:00:00"), "--at '2030-01-01T12:00:00': a naive datetime"),
    (("--at", "next tuesday"), "--at 'next tuesday': not a time"),
    (("--delay=-5m",), "--delay '-5m': a negative delay"),
    (("--delay", "99999h"), "more than limits.max_schedule_ahead (400d) ahead"),
    (("--delay", "401d"), "--delay '401d': 401d is more than limits.max_schedule_ahead (400d)"),
    (("--at", "2099-01-01T00:00:00Z"), "2099-01-01T00:00:00+00:00 is more than "
     "limits.max_schedule_ahead (400d) ahead"),
    (("--at", "1969-07-20T20:17:00Z"), "1969-07-20T20:17:00+00:00 is before the epoch"),
])
def test_touch_with_a_bad_time_exits_2_and_touches_nothing(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis,
        *, args: tuple[str, ...], says: str) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("touch", "item:1", *args, "--rules", str(rules), "--redis", redis_url,
               cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr and "nothing was touched" in done.stderr
    assert r.keys(f"{namespace}:*") == []


def test_at_and_delay_together_are_refused_by_the_parser(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("touch", "item:1", "--at", "2030-01-01T12:00:00Z", "--delay", "5m",
               "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 2
    assert "not allowed with argument" in done.stderr
