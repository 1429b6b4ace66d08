"""`coalescer keys` and `coalescer audit` through the CLI's own argument parsing on a
real server: listing by capture and state with a cursor, bulk actions that count first
and act only with --yes, Ctrl-C stopping a bulk action after its page (a real child
process), the audit trail of it all, and every bad argument refused by name."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from coalescer.cli.main import main
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import clean_env, coalescer_cmd

RULES = """\
namespace: {ns}
shards: 2
defaults: {{window: 1h, max_wait: 2h, absorb: 5ms}}
rules:
  - name: acct
    match: "acct:{{org}}:{{user}}"
    handler: builtins:repr
"""

NOW_MS = int(time.time() * 1000)  # dead letters of now: none past dead_letter_ttl


@pytest.fixture
def setup(tmp_path: Path, namespace: str, redis_url: str) -> list[str]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES.format(ns=namespace))
    return ["--rules", str(rules), "--redis", redis_url]


def kill(redis_url: str, namespace: str, keys: list[str]) -> None:
    space = KeySpace(namespace, 2)
    with sync_redis.Redis.from_url(redis_url, decode_responses=True) as r:
        pipe = r.pipeline(transaction=False)
        for n, key in enumerate(keys):
            sk = space.shard(space.shard_of(key))
            pipe.hset(sk.meta, key, "D|1|1|5|boom")
            pipe.zadd(sk.dead("acct"), {key: NOW_MS + n})
        pipe.execute()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_lists_by_capture_and_pages_with_a_cursor(
        setup: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    keys = [f"acct:{org}:{u}" for org in (1, 2) for u in range(8)]
    assert run(capsys, "touch", *keys, *setup)[0] == 0
    code, out, err = run(capsys, "keys", "--rule", "acct", "--where", "org=2", "-n", "3",
                         "--json", *setup)
    first = json.loads(out)
    assert code == 0 and len(first["keys"]) == 3 and first["cursor"]
    assert {k["captures"]["org"] for k in first["keys"]} == {"2"}
    code, out, err = run(capsys, "keys", "--rule", "acct", "--where", "org=2", "-n", "100",
                         "--cursor", first["cursor"], *setup)
    rest = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and len(rest) == 5
    assert sorted(rest + [k["key"] for k in first["keys"]]) == sorted(keys[8:])
    assert "5 keys (the pending keys of rule acct where org=2)" in err
    assert "more:" not in err
    code, out, err = run(capsys, "keys", "--rule", "acct", "--state", "paused", *setup)
    assert (code, out) == (0, "") and "rule acct is not paused: no key waits" in err
    assert run(capsys, "pause", "acct", *setup)[0] == 0
    code, out, err = run(capsys, "keys", "--rule", "acct", "--state", "paused", "-n", "100",
                         *setup)
    assert code == 0 and len(out.splitlines()) == 16 and "not paused" not in err


def test_a_bulk_retry_counts_first_then_acts_with_yes_and_is_audited(
        setup: list[str], namespace: str, redis_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    kill(redis_url, namespace, [f"acct:{org}:{u}" for org in (1, 2) for u in range(10)])
    code, out, err = run(capsys, "keys", "--rule", "acct", "--where", "org=1", "--retry",
                         *setup)
    assert code == 1 and "would act on 10 keys" in out
    assert "nothing was done: pass --yes to retry 10 keys" in err
    code, out, _ = run(capsys, "keys", "--rule", "acct", "--where", "org=1", "--retry",
                       "--dry-run", *setup)
    assert code == 0 and "would act on 10 keys" in out
    code, out, _ = run(capsys, "keys", "--rule", "acct", "--where", "org=1", "--retry",
                       "--yes", "--json", *setup)
    done = json.loads(out)
    assert code == 0 and (done["matched"], done["done"], done["status"]) == (10, 10, "done")
    code, out, _ = run(capsys, "keys", "--rule", "acct", "--state", "dead", "--json", *setup)
    assert {k["captures"]["org"] for k in json.loads(out)["keys"]} == {"2"}
    code, out, _ = run(capsys, "keys", "--rule", "acct", "--purge", "--yes", *setup)
    assert code == 0 and out.startswith("purged 10 of 10 matched (the dead keys of rule acct)")
    code, out, _ = run(capsys, "audit", "--json", *setup)
    entries = json.loads(out)
    assert [(e["action"], e["count"]) for e in entries] == [("purge", 10), ("retry", 10)]
    assert entries[1]["target"] == "the dead keys of rule acct where org=1"
    assert json.loads(entries[1]["detail"])["bulk"] == "done"
    code, out, _ = run(capsys, "audit", "-n", "1", "--before", entries[0]["id"], *setup)
    assert code == 0 and "retry the dead keys of rule acct where org=1: 10 changed" in out


@pytest.mark.parametrize(("argv", "says"), [
    (["--where", "org"], "--where 'org': expected CAPTURE=VALUE, e.g. org=42"),
    (["--where", "team=1"], "has no capture 'team' (its captures: org, user)"),
    (["--state", "stuck"], "--state 'stuck': not a state; one of pending, scheduled"),
    (["--cursor", "nonsense"], "--cursor 'nonsense': not a cursor"),
    (["--retry", "--state", "pending"], "retry acts on dead keys, not on --state pending"),
    (["--retry", "--cancel"], "--retry and --cancel: give one action"),
    (["--dry-run"], "--dry-run, --yes and --rate go with an action"),
    (["--rule", "nope"], "no rule named 'nope' (its rules: acct)"),
])
def test_bad_arguments_are_refused_naming_the_part(
        setup: list[str], capsys: pytest.CaptureFixture[str], argv: list[str],
        says: str) -> None:
    code, out, err = run(capsys, "keys", "--rule", "acct", *argv, *setup)
    assert (code, out) == (2, "") and says in err


def test_audit_refuses_a_bad_entry_id(setup: list[str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "audit", "--before", "yesterday", *setup)
    assert code == 2 and "--before 'yesterday': not an entry id" in err


def test_ctrl_c_stops_a_bulk_action_after_its_page_and_says_how_many(
        tmp_path: Path, setup: list[str], namespace: str, redis_url: str) -> None:
    kill(redis_url, namespace, [f"acct:1:{u}" for u in range(400)])
    proc = subprocess.Popen([*coalescer_cmd(), "keys", "--rule", "acct", "--retry", "--yes",
                             "--rate", "40", "--json", *setup], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # the first progress line: it is acting
    assert "retry:" in line and "done of" in line, line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    stopped: dict[str, Any] = json.loads(out)
    assert stopped["status"] == "aborted" and 0 < stopped["done"] < 400
    assert f"stopped after {stopped['done']} keys" in err
    with sync_redis.Redis.from_url(redis_url, decode_responses=True) as r:
        space = KeySpace(namespace, 2)
        dead = sum(r.zcard(space.shard(n).dead("acct")) for n in range(2))
        assert dead == 400 - stopped["done"]
