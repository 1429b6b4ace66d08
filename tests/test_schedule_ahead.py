"""``limits.max_schedule_ahead``: a touch scheduled further away is refused at the call,
naming the time and the limit (the Python API here; HTTP and the CLI in their own tests),
and a source's event past it is rejected; on a real valkey-server. The field itself is
validated at load, naming the file, line and field."""

from __future__ import annotations

import time
from typing import Any

import pytest

from coalescer import InvalidScheduleError
from coalescer.config.rules import Config
from coalescer.errors import ConfigError
from coalescer.store.keys import KeySpace
from tests.conftest import RulesFactory, Start

RULES = """\
namespace: {ns}
limits: {{max_schedule_ahead: 1h}}
defaults: {{window: 1h, max_wait: 1h, absorb: 10ms}}
rules:
  - name: order
    match: "order:{{id}}"
    handler: builtins:repr
"""


async def test_a_schedule_past_the_limit_is_refused_naming_time_and_limit(
        rules_file: RulesFactory, start: Start, redis_url: str, namespace: str,
        redis_client: Any) -> None:
    c = await start(rules_file(RULES.format(ns=namespace)), redis_url=redis_url,
                    worker=False)
    with pytest.raises(InvalidScheduleError) as refused:
        c.touch("order:1", delay="2h")
    assert "2h is more than limits.max_schedule_ahead (1h) ahead" in str(refused.value)
    with pytest.raises(InvalidScheduleError) as refused:
        c.touch_many(["order:2", "order:3"], at=time.time() + 7200)
    assert "more than limits.max_schedule_ahead (1h) ahead" in str(refused.value)
    c.touch("order:4", delay="59m")  # inside the limit
    c.touch("order:5", at=time.time() + 3000)
    await c.flush()
    due = KeySpace(namespace, 1).shard(0).due("order")
    assert sorted(await redis_client.zrange(due, 0, -1)) == ["order:4", "order:5"]


@pytest.mark.parametrize(("value", "says"), [
    ("0s", "must be longer than 0"),
    ("3651d", "must be at most 3650d (10 years)"),
    ("soon", "bad duration"),
])
def test_a_bad_max_schedule_ahead_names_file_line_and_field(value: str, says: str) -> None:
    text = (f"namespace: x\nlimits:\n  max_schedule_ahead: {value}\nrules:\n"
            "  - name: a\n    match: 'a:{id}'\n    handler: builtins:repr\n")
    with pytest.raises(ConfigError) as info:
        Config.from_string(text, source="rules.yaml")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", 3, "limits.max_schedule_ahead")
    assert says in err.message


@pytest.mark.parametrize(("value", "says"), [
    ("0", "must be from 1 byte"),
    ("12XB", "bad size '12XB'"),
    ("'" + "9" * 40 + "'", "bad size"),
    ("-5", "bad size -5"),
])
def test_a_bad_pending_bytes_names_file_line_and_field(value: str, says: str) -> None:
    text = (f"namespace: x\nlimits:\n  pending_bytes: {value}\nrules:\n"
            "  - name: a\n    match: 'a:{id}'\n    handler: builtins:repr\n")
    with pytest.raises(ConfigError) as info:
        Config.from_string(text, source="rules.yaml")
    err = info.value
    assert (err.file, err.line, err.field) == ("rules.yaml", 3, "limits.pending_bytes")
    assert says in err.message


def test_the_limits_defaults_and_sizes_with_units() -> None:
    base = "rules:\n  - name: a\n    match: 'a:{id}'\n    handler: builtins:repr\n"
    limits = Config.from_string(base, source="rules.yaml").limits
    assert (limits.pending_bytes, limits.max_schedule_ahead) == (1 << 30, 400 * 86_400)
    limits = Config.from_string("limits: {pending_bytes: 64MiB, max_schedule_ahead: 30d}\n"
                                + base, source="rules.yaml").limits
    assert (limits.pending_bytes, limits.max_schedule_ahead) == (64 << 20, 30 * 86_400)
