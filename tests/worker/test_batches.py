"""Batch rules: the handler gets a list of claims, each key keeps its own outcome."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from coalescer import Claim, Coalescer
from coalescer.config.rules import Config
from coalescer.errors import ConfigError, WebhookError
from coalescer.query.explain import format_explain
from coalescer.query.history import HistoryQuery, format_history
from coalescer.worker.batches import BatchAnswerError, failed_keys
from coalescer.worker.registry import fingerprint
from coalescer.worker.webhooks import failed_of_answer
from tests.helpers.servers import wait_until

HANDLERS = """\
calls = []
answers = []  # what the next calls return (popped), then None


async def refresh(claims):
    calls.append(list(claims))
    if answers:
        answer = answers.pop(0)
        if callable(answer):
            return await answer(claims)
        return answer
    return None
"""

RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    handler: handlers:refresh
    window: 100ms
    absorb: 10ms
    timeout: {timeout}
    concurrency: {concurrency}
    retry: {{attempts: 2, backoff: 10ms, max_backoff: 10ms}}
    batch: {{max: {max}, wait: {wait}}}
"""

Start = Callable[..., Awaitable[tuple[Coalescer, Any]]]


@pytest_asyncio.fixture
async def start(tmp_path: Path, namespace: str, redis_url: str,
                rules_file: Any) -> AsyncIterator[Start]:
    async with AsyncExitStack() as stack:
        async def make(*, size: int = 10, wait: str = "0s", timeout: str = "5s",
                       worker: bool = True, shards: int = 1,
                       concurrency: int = 16) -> tuple[Coalescer, Any]:
            path = rules_file(RULES.format(ns=namespace, max=size, wait=wait, timeout=timeout,
                                           shards=shards, concurrency=concurrency), HANDLERS)
            config = Config.from_yaml(path)  # imports the handlers module
            c = Coalescer(config, redis_url=redis_url, worker=worker, grace=2.0)
            await stack.enter_async_context(c)
            return c, sys.modules["handlers"]

        yield make


def keys(n: int) -> list[str]:
    return [f"stats:customer:{i}" for i in range(n)]


def called(handlers: Any) -> list[str]:
    return [claim.key for batch in handlers.calls for claim in batch]


@pytest.mark.parametrize(("worker", "shards"), [(False, 1), (True, 1), (False, 4)],
                         ids=["write-only-1-shard", "worker-1-shard", "write-only-4-shards"])
async def test_a_batch_handler_gets_lists_of_at_most_max_claims_each_key_once(
        start: Start, worker: bool, shards: int) -> None:
    c, handlers = await start(size=10, worker=worker, shards=shards)
    c.touch_many(keys(25) * 2)

    claims = await c.drain(timeout=20)

    assert sorted(cl.key for cl in claims) == sorted(keys(25))
    assert all(len(batch) <= 10 for batch in handlers.calls)
    if shards == 1:
        assert [len(batch) for batch in handlers.calls] == [10, 10, 5]
    assert sorted(called(handlers)) == sorted(keys(25))
    assert all(isinstance(cl, Claim) and cl.params == {"id": cl.key.split(":")[2]}
               for batch in handlers.calls for cl in batch)
    assert len({(cl.key, cl.token) for cl in claims}) == 25  # each key its own claim
    done = await c.query.history(HistoryQuery(limit=100))
    assert sorted(r.key for r in done if r.outcome == "success") == sorted(keys(25))
    status = await c.query.status()
    assert (status["rules"]["customer"]["pending"], status["rules"]["customer"]["in_flight"]) \
        == (0, 0)


async def test_a_worker_runs_due_keys_in_batches_and_counts_their_sizes(start: Start) -> None:
    c, handlers = await start(size=10)
    c.touch_many(keys(30))
    await c.flush()

    await wait_until(lambda: len(called(handlers)) == 30, message="30 keys refreshed")

    assert sorted(called(handlers)) == sorted(keys(30))
    assert all(len(batch) <= 10 for batch in handlers.calls)
    sample = c.metrics.registry.get_sample_value
    labels = {"rule": "customer"}
    assert sample("coalescer_batch_size_count", labels) == len(handlers.calls)
    assert sample("coalescer_batch_size_sum", labels) == 30
    assert sample("coalescer_refreshes_total", labels | {"outcome": "success"}) == 30


async def test_a_batch_waits_for_more_keys_up_to_its_wait(start: Start) -> None:
    c, handlers = await start(size=100, wait="3s")
    c.touch("stats:customer:1")
    await c.flush()

    async def claimed() -> bool:
        status = await c.query.status()
        return int(status["rules"]["customer"]["in_flight"]) == 1

    await wait_until(claimed, message="the first key claimed")
    c.touch("stats:customer:2")
    await c.flush()

    await wait_until(lambda: len(called(handlers)) == 2, message="both keys refreshed")
    # one call with both: the first key waited for the second, not a call each
    assert [sorted(cl.key for cl in batch) for batch in handlers.calls] == [
        ["stats:customer:1", "stats:customer:2"]]


async def test_only_the_keys_a_batch_handler_returns_are_retried(start: Start) -> None:
    c, handlers = await start(size=10, worker=False)
    handlers.answers = [["stats:customer:1", "stats:customer:3"]]
    c.touch_many(keys(5))

    await c.drain(timeout=20)

    assert [sorted(cl.key for cl in batch) for batch in handlers.calls] == [
        keys(5), ["stats:customer:1", "stats:customer:3"]]
    assert [cl.attempt for cl in handlers.calls[1]] == [2, 2]
    assert (await c.query.status())["rules"]["customer"]["dead"] == 0


async def test_a_key_failing_every_attempt_is_dead_lettered_alone_with_its_error(
        start: Start) -> None:
    c, handlers = await start(size=10, worker=False)
    handlers.answers = [{"stats:customer:2": "no such customer"}] * 2
    c.touch_many(keys(4))

    await c.drain(timeout=20)

    page = await c.query.dead_letters()
    assert [(d["key"], d["attempts"]) for d in page.entries] == [("stats:customer:2", 2)]
    assert "no such customer" in page.entries[0]["error"]
    assert called(handlers).count("stats:customer:2") == 2
    assert called(handlers).count("stats:customer:0") == 1


async def test_a_raising_batch_handler_fails_every_key_of_the_batch(start: Start) -> None:
    c, handlers = await start(size=10, worker=False)

    async def boom(claims: list[Claim]) -> None:
        raise RuntimeError("database down")
    handlers.answers = [boom]
    c.touch_many(keys(3))

    await c.drain(timeout=20)

    assert [sorted(cl.key for cl in batch) for batch in handlers.calls] == [keys(3), keys(3)]
    assert {cl.attempt for cl in handlers.calls[1]} == {2}


async def test_a_garbage_answer_is_logged_and_every_key_retried(
        start: Start, caplog: pytest.LogCaptureFixture) -> None:
    c, handlers = await start(size=10, worker=False)
    handlers.answers = [42, ["stats:customer:99"]]
    c.touch_many(keys(3))

    with caplog.at_level(logging.ERROR, logger="coalescer.worker.runner"):
        await c.drain(timeout=20)

    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("returned 42" in e and "failing all 3 keys" in e for e in errors)
    assert any("'stats:customer:99'" in e and "not a key of this batch" in e for e in errors)
    # nothing lost: both bad answers failed every key, whose last attempt went to dead letters
    page = await c.query.dead_letters()
    assert sorted(d["key"] for d in page.entries) == keys(3)


async def test_a_batch_past_its_timeout_times_out_every_key(start: Start) -> None:
    c, handlers = await start(size=10, timeout="200ms", worker=False)
    never = asyncio.Event()

    async def hang(claims: list[Claim]) -> None:
        await never.wait()
    handlers.answers = [hang]
    c.touch_many(keys(3))

    await c.drain(timeout=20)

    assert [len(batch) for batch in handlers.calls] == [3, 3]
    assert {cl.attempt for cl in handlers.calls[1]} == {2}
    entries = await c.query.history(HistoryQuery(limit=20))
    outcomes = sorted((e.key, e.outcome) for e in entries)
    assert outcomes == sorted([(k, "timeout") for k in keys(3)] +
                              [(k, "success") for k in keys(3)])


async def test_a_touch_during_a_batch_rearms_that_key_only(start: Start) -> None:
    c, handlers = await start(size=10)
    touched = asyncio.Event()

    async def touch_one(claims: list[Claim]) -> None:
        c.touch("stats:customer:1")
        await c.flush()
        touched.set()
    handlers.answers = [touch_one]
    c.touch_many(keys(3))
    await c.flush()

    await wait_until(lambda: len(handlers.calls) == 2, message="the re-armed key ran again")
    assert [cl.key for cl in handlers.calls[1]] == ["stats:customer:1"]
    assert handlers.calls[1][0].token > handlers.calls[0][0].token


async def test_a_batch_webhook_gets_one_post_and_names_its_failed_keys(
        tmp_path: Path, namespace: str, redis_url: str, rules_file: Any) -> None:
    bodies: list[list[dict[str, Any]]] = []

    async def receive(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        failed = ["stats:customer:0"] if len(bodies) == 1 else []
        return web.json_response({"failed": failed})

    app = web.Application()
    app.router.add_post("/batch", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        path = rules_file(f"""\
            namespace: {namespace}
            rules:
              - name: customer
                match: "stats:customer:{{id}}"
                handler: {{http: {{url: "http://127.0.0.1:{port}/batch"}}}}
                retry: {{attempts: 3, backoff: 10ms, max_backoff: 10ms}}
                batch: {{max: 10}}
            """)
        async with Coalescer.from_yaml(path, redis_url=redis_url, worker=False) as c:
            c.touch_many(keys(3))
            await c.drain(timeout=20)
    finally:
        await runner.cleanup()

    assert [sorted(claim["key"] for claim in body) for body in bodies] == [
        keys(3), ["stats:customer:0"]]
    assert bodies[0][0]["rule"] == "customer" and "token" in bodies[0][0]
    assert bodies[1][0]["attempt"] == 2


@pytest.mark.parametrize(("batch", "message", "field"), [
    ("{max: 0}", "must be a positive whole number", "rules[0].batch.max"),
    ("{max: 100001}", "must be at most 10000", "rules[0].batch.max"),
    ("{max: 10, wait: 1m}", "must be at most 10s", "rules[0].batch.wait"),
    ("{max: 10, wait: soon}", "bad duration", "rules[0].batch.wait"),
    ("{wait: 1s}", "missing the required field 'max'", "rules[0].batch.max"),
    ("{max: 10, size: 3}", "size", "rules[0].batch.size"),
    ("500", "batch must be a mapping", "rules[0].batch"),
])
def test_a_bad_batch_setting_is_refused_with_its_line_and_field(
        batch: str, message: str, field: str) -> None:
    text = (f"rules:\n  - name: r\n    match: \"k:*\"\n    handler: json:dumps\n"
            f"    batch: {batch}\n")
    with pytest.raises(ConfigError) as caught:
        Config.from_string(text, source="rules.yaml")
    (error,) = caught.value.errors
    assert message in str(error)
    assert (error.file, error.line, error.field) == ("rules.yaml", 5, field)


def test_a_batch_webhook_url_cannot_use_a_capture() -> None:
    text = ("rules:\n  - name: r\n    match: \"k:{id}\"\n"
            "    handler: {http: {url: \"http://127.0.0.1:9/{id}\"}}\n"
            "    batch: {max: 10}\n")
    with pytest.raises(ConfigError) as caught:
        Config.from_string(text, source="rules.yaml")
    assert "cannot use a {capture}" in str(caught.value)
    assert caught.value.errors[0].field == "rules[0].batch"


def test_a_batch_rule_describes_its_batch() -> None:
    text = ("rules:\n  - name: r\n    match: \"k:*\"\n    handler: json:dumps\n"
            "    batch: {max: 500, wait: 50ms}\n")
    assert "batch: max 500, wait 50ms" in Config.from_string(text).describe()
    assert json.dumps  # the handler the rules name


async def test_history_and_explain_show_each_key_of_a_batch_with_its_size(
        start: Start) -> None:
    c, handlers = await start(size=10, worker=False)
    handlers.answers = [["stats:customer:2"]]
    c.touch_many(keys(4))

    await c.drain(timeout=20)

    mine = await c.query.history(HistoryQuery(key="stats:customer:1"))
    assert [(r.outcome, r.batch, r.attempt) for r in mine] == [("success", 4, 1)]
    assert mine[0].token == handlers.calls[0][1].token
    assert "(batch of 4)" in format_history(mine)
    everything = await c.query.history(HistoryQuery(limit=100))
    assert sorted((r.key, r.outcome) for r in everything) == sorted(
        [(k, "success") for k in keys(4)] + [("stats:customer:2", "failure")])
    info = await c.query.explain("stats:customer:3")
    assert [r["batch"] for r in info["last_refreshes"]] == [4]
    text = format_explain(info)
    assert "batch of 4" in text and "batch up to 10 keys a call" in text


# -- what a batch handler's answer means ---------------------------------------------------

BATCH = [Claim(key=f"k:{i}", rule="r", token=i) for i in range(3)]


@pytest.mark.parametrize(("answer", "failed"), [
    (None, {}),
    ([], {}),
    (["k:1"], {"k:1": "reported failed by the batch handler"}),
    ((c for c in BATCH[:2]), {"k:0": "reported failed by the batch handler",
                              "k:1": "reported failed by the batch handler"}),
    ({"k:2": "no such row"}, {"k:2": "no such row"}),
    ({"k:0": ValueError("bad total")}, {"k:0": "bad total"}),
    ({"k:1": None}, {"k:1": "reported failed by the batch handler"}),
])
def test_a_batch_answer_names_the_failed_keys_with_their_errors(
        answer: object, failed: dict[str, str]) -> None:
    found = failed_keys(answer, BATCH)
    assert {key: str(exc) for key, exc in found.items()} == failed


@pytest.mark.parametrize(("answer", "message"), [
    (42, "batch handler returned 42; expected None (all succeeded)"),
    ("k:1", "batch handler returned 'k:1'; expected None"),
    ([7], "returned 7 among its failed keys; expected a Claim or a key (str)"),
    (["k:9"], "returned 'k:9' as failed, which is not a key of this batch"),
    ({"k:1": 3.5}, "returned 3.5 as the error of 'k:1'"),
])
def test_a_batch_answer_that_names_no_failed_keys_is_refused_saying_why(
        answer: object, message: str) -> None:
    with pytest.raises(BatchAnswerError, match=re.escape(message)):
        failed_keys(answer, BATCH)


@pytest.mark.parametrize(("body", "failed"), [
    (b"", None),
    (b"ok", None),
    (b'{"refreshed": 3}', None),
    (b'{"failed": null}', None),
    (b'{"failed": ["k:1"]}', ["k:1"]),
    (b'{"failed": {"k:1": "gone"}}', {"k:1": "gone"}),
])
def test_a_batch_webhook_answer_gives_its_failed_field(body: bytes, failed: object) -> None:
    assert failed_of_answer(body, "POST", "http://127.0.0.1:9/b") == failed


def test_a_batch_webhook_answer_with_a_bad_failed_field_is_an_error() -> None:
    with pytest.raises(WebhookError, match=r"POST http://127\.0\.0\.1:9/b answered with a "
                                           r"'failed' field that is neither"):
        failed_of_answer(b'{"failed": 3}', "POST", "http://127.0.0.1:9/b")


async def test_a_drain_skips_a_batch_wait(start: Start) -> None:
    c, handlers = await start(size=100, wait="10s", worker=False)
    c.touch_many(keys(3))

    claims = await c.drain(timeout=5)  # would time out waiting 10s for a fuller batch

    assert sorted(cl.key for cl in claims) == keys(3)
    assert [len(batch) for batch in handlers.calls] == [3]


def test_nodes_with_and_without_a_rules_batch_see_the_rule_differ() -> None:
    text = "rules:\n  - name: r\n    match: \"k:*\"\n    handler: json:dumps\n"
    plain = Config.from_string(text).rules[0]
    batched = Config.from_string(text + "    batch: {max: 50}\n").rules[0]
    bigger = Config.from_string(text + "    batch: {max: 60}\n").rules[0]
    assert len({fingerprint(plain), fingerprint(batched), fingerprint(bigger)}) == 3


async def test_concurrency_counts_batch_calls_not_keys(start: Start) -> None:
    c, handlers = await start(size=2, concurrency=2, worker=False)
    active, most = [0], [0]
    both = asyncio.Event()

    async def together(claims: list[Claim]) -> None:
        active[0] += 1
        most[0] = max(most[0], active[0])
        if active[0] == 2:
            both.set()
        try:
            await asyncio.wait_for(both.wait(), 10)  # two calls of two keys run at once
        finally:
            active[0] -= 1
    handlers.answers = [together] * 3
    c.touch_many(keys(6))

    await c.drain(timeout=20)

    assert [len(batch) for batch in handlers.calls] == [2, 2, 2]
    assert most[0] == 2  # never a third call beside them
    assert (await c.query.status())["rules"]["customer"]["dead"] == 0
