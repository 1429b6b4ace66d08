"""What a node logs about refreshes: one line per kind of failure per period (the first
with its traceback, the others counted), one line when a key is dead-lettered (not when a
touch re-armed it), successes at DEBUG."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from coalescer import Claim, Coalescer
from coalescer.worker.failure_log import FailureLog
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until

# Every setting at its default (5 attempts, concurrency 16, timeout 30s) but the
# windows and backoffs, kept short so the retries run quickly.
RULES = """\
namespace: {ns}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 10ms
  retry: {{attempts: 5, backoff: 1ms, max_backoff: 1ms}}
rules:
  - name: item
    match: "item:{{id}}"
    handler: {mod}:refresh
  - name: once
    match: "once:{{id}}"
    retry: {{attempts: 1}}
    handler: {mod}:refresh
"""


def runner_lines(caplog: pytest.LogCaptureFixture, key: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "coalescer.worker.runner" and key in r.getMessage().split()[:4]]


async def dead(c: Coalescer, rule: str) -> int:
    return int((await c.query.status())["rules"][rule]["dead"])


async def test_first_failure_of_a_kind_has_its_traceback_its_retries_are_counted(
        tmp_path: Path, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="coalescer")
    rules, rec = recorder_rules(tmp_path, f"log_{namespace}", RULES.format(
        ns=namespace, mod=f"log_{namespace}"))

    async def hook(claim: Claim) -> None:
        if claim.key != "item:ok":
            raise RuntimeError(f"db down for {claim.key}")

    rec.hook = hook
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=1) as c:
        c.touch_many(["item:7", "once:1", "item:ok"])
        await c.flush()
        await wait_until(lambda: dead(c, "item"), message="item:7 dead-lettered")
        await wait_until(lambda: dead(c, "once"), message="once:1 dead-lettered")
        await wait_until(lambda: rec.succeeded, message="item:ok refreshed")

    fails = [r for r in runner_lines(caplog, "item:7") if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in fails] == [  # the 4 retries: the same kind, left out
        "refresh of item:7 failed (attempt 1 of 5): RuntimeError: db down for item:7; "
        "retry in 0.001s"]
    assert [r.exc_info is not None for r in fails] == [True]
    assert fails[0].exc_info is not None and "in hook" in "".join(
        logging.Formatter().formatException(fails[0].exc_info))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    options = f"--rules {rules} --redis {redis_url}"  # the node's own, so a paste works
    assert sorted(errors) == [
        "item:7 dead-lettered after 5 attempts: RuntimeError: db down for item:7; "
        f"re-queue with `coalescer dead retry {options} item:7`",
        "once:1 dead-lettered after 1 attempt: RuntimeError: db down for once:1; "
        f"re-queue with `coalescer dead retry {options} once:1`"]
    [done] = runner_lines(caplog, "item:ok")
    assert done.levelno == logging.DEBUG
    token = rec.succeeded[0].token
    assert done.getMessage().startswith("refreshed item:ok in ")
    assert done.getMessage().endswith(f" ms (attempt 1, token {token})")


async def test_a_key_touched_during_its_last_attempt_is_not_reported_dead(
        tmp_path: Path, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="coalescer")
    rules, rec = recorder_rules(tmp_path, f"log_{namespace}", RULES.format(
        ns=namespace, mod=f"log_{namespace}"))
    holder: list[Coalescer] = []

    async def hook(claim: Claim) -> None:
        if len(rec.calls) > 5:
            return  # the new burst's first attempt succeeds
        if claim.attempt == 5:  # the last attempt: a write path touches the key meanwhile
            holder[0].touch(claim.key)
            await holder[0].flush()
        raise RuntimeError("flaky")

    rec.hook = hook
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=1) as c:
        holder.append(c)
        c.touch("item:9")
        await c.flush()
        await wait_until(lambda: rec.succeeded, message="item:9 refreshed after the touch")
    assert [claim.attempt for claim in rec.calls] == [1, 2, 3, 4, 5, 1]
    assert not [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    lines = runner_lines(caplog, "item:9")
    assert [r.levelno for r in lines] == [logging.WARNING, logging.DEBUG]  # retries counted
    assert lines[-1].getMessage().startswith("refreshed item:9 in ")


async def test_many_keys_failing_the_same_way_log_one_line_and_one_traceback(
        tmp_path: Path, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # each distinct failing key used to log its own traceback (15 MB for 5,000 keys)
    caplog.set_level(logging.DEBUG, logger="coalescer")
    rules, rec = recorder_rules(tmp_path, f"log_{namespace}", RULES.format(
        ns=namespace, mod=f"log_{namespace}"))

    async def hook(claim: Claim) -> None:
        raise RuntimeError(f"db down for {claim.key}")

    rec.hook = hook
    keys = [f"once:{n}" for n in range(40)]
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=1) as c:
        c.touch_many(keys)
        await c.flush()
        await wait_until(lambda: _dead_is(c, "once", 40), message="40 keys dead-lettered")
    records = [r for r in caplog.records if r.name == "coalescer.worker.runner"
               and r.levelno >= logging.WARNING]
    assert len([r for r in records if "failed (attempt" in r.getMessage()]) == 1
    assert len([r for r in records if "dead-lettered after" in r.getMessage()]) == 1
    assert len([r for r in records if r.exc_info is not None]) == 1


async def _dead_is(c: Coalescer, rule: str, count: int) -> bool:
    return await dead(c, rule) == count


def test_a_kind_left_out_within_its_period_is_counted_on_its_next_line() -> None:
    now = [0.0]
    failures = FailureLog(period=60.0, clock=lambda: now[0])
    kind = ("failed", "item", "RuntimeError")
    assert failures.admit(kind) == 0
    assert [failures.admit(kind) for _ in range(3)] == [None, None, None]
    assert failures.admit(("failed", "item", "TimeoutError")) == 0  # another kind
    now[0] = 60.0
    left_out = failures.admit(kind)
    assert left_out == 3
    assert "3 more of this kind in the last 60s were not logged" in failures.note(left_out)
    assert failures.note(0) == ""


async def test_a_newline_past_200_characters_of_an_error_forges_no_log_line(
        tmp_path: Path, redis_url: str, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    # the traceback used to be escaped only when the key or the first 200 characters of
    # the error changed once escaped: a newline after them printed a forged line
    from coalescer.cli.main import LOG_FORMAT, RedactingFormatter

    caplog.set_level(logging.DEBUG, logger="coalescer")
    rules, rec = recorder_rules(tmp_path, f"log_{namespace}", RULES.format(
        ns=namespace, mod=f"log_{namespace}"))
    forged = "2026-01-01 00:00:00,000 CRITICAL coalescer: forged"

    async def hook(claim: Claim) -> None:
        raise RuntimeError("y" * 210 + "\n" + forged)

    rec.hook = hook
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="n1", grace=1) as c:
        c.touch("once:\u200f\ufeff1")
        await c.flush()
        await wait_until(lambda: dead(c, "once"), message="once:1 dead-lettered")
    formatter = RedactingFormatter(LOG_FORMAT)
    lines = [line for r in caplog.records if r.name == "coalescer.worker.runner"
             for line in formatter.format(r).splitlines()]
    assert not any(line.startswith("2026-01-01") for line in lines)
    failed = [line for line in lines if "failed (attempt" in line]
    assert failed and "once:\\u200f\\ufeff1" in failed[0]
    assert "\\x0a" + forged in failed[0]  # the traceback, escaped, on the line
