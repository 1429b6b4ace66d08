"""POST /rules/{rule}/pause, /resume and POST /keys/{key}/run over real HTTP against a
real node: what they do, their 404s, and the guards every state change gets (token,
Host, cross-site, JSON body)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.servers import free_port, wait_until
from tests.web.test_api import TOKEN, Node, NodeFactory, make_node  # noqa: F401 (make_node: a fixture)
from tests.web.test_guards import raw_http


async def post(node: Node, path: str, **kwargs: Any) -> tuple[int, Any]:
    """POST ``path`` with the JSON body a page's button sends (``{}``)."""
    status, body, _ = await node.request("POST", path, json={}, **kwargs)
    return status, body


ROUTES = ["/rules/user-stats/pause", "/rules/user-stats/resume", "/keys/stats:user:1/run"]


async def test_pause_holds_a_rule_and_resume_runs_its_keys(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node()
    status, body = await post(node, "/rules/user-stats/pause")
    assert (status, body) == (200, {"rule": "user-stats", "paused": True, "changed": True})
    await wait_until(lambda: node.c.metrics.registry.get_sample_value(
        "coalescer_rule_paused", {"rule": "user-stats"}) == 1)
    assert (await node.touch({"keys": ["stats:user:1", "stats:customer:1"]}))[0] == 202
    await wait_until(lambda: [c.key for c in node.seen] == ["stats:customer:1"])
    status, body, _ = await node.request("GET", "/status")
    assert body["rules"]["user-stats"]["paused"] is True
    assert body["rules"]["user-stats"]["pending"] == 1
    status, body = await post(node, "/rules/user-stats/resume")
    assert (status, body) == (200, {"rule": "user-stats", "paused": False, "changed": True})
    await wait_until(lambda: sorted(c.key for c in node.seen) == [
        "stats:customer:1", "stats:user:1"], message="the paused key refreshed")


async def test_run_answers_for_a_pending_key_and_404s_an_idle_or_unmatched_one(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    assert (await node.touch({"keys": ["stats:user:1"]}))[0] == 202
    await node.c.flush()
    status, body = await post(node, "/keys/stats:user:1/run")
    assert status == 200 and body["run"] is True and body["state"] in ("hastened", "due")
    status, body = await post(node, "/keys/stats:user:2/run")
    assert status == 404
    assert body == {"error": "key 'stats:user:2' is not pending (idle); nothing was run",
                    "key": "stats:user:2", "run": False, "state": "idle"}
    status, body = await post(node, "/keys/nomatch/run")
    assert status == 404 and body["error"] == "no rule matches key 'nomatch'"


async def test_an_unknown_rule_is_404_naming_the_rules(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    for action in ("pause", "resume"):
        status, body = await post(node, f"/rules/nope/{action}")
        assert status == 404
        assert body == {"error": "no rule named 'nope'", "rule": "nope",
                        "rules": ["user-stats", "customer-stats"]}
    assert await node.c.query.paused() == []


@pytest.mark.parametrize("path", ROUTES)
async def test_every_control_needs_the_token(make_node: NodeFactory,  # noqa: F811
                                             path: str) -> None:
    node = await make_node(worker=False, token=TOKEN)
    status, body = await post(node, path)
    assert status == 401, body
    status, body = await post(node, path, token="wrong")
    assert status == 401, body
    status, _ = await post(node, path, token=TOKEN)
    assert status != 401
    assert await node.c.query.paused() == (["user-stats"] if path.endswith("pause") else [])


@pytest.mark.parametrize("path", ROUTES)
async def test_every_control_refuses_a_rebinding_host(make_node: NodeFactory,  # noqa: F811
                                                      path: str) -> None:
    node = await make_node(worker=False)
    host = f"attacker.example:{node.api.port}"
    status, _, body = await raw_http(node.api.port, f"POST {path} HTTP/1.1\r\nHost: {host}\r\n")
    assert status == 421, body
    assert await node.c.query.paused() == []


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:{other}"},
    {"Origin": "null"},
    {"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "cross-site"},
], ids=["other-site", "other-port", "null", "cross-site-fetch"])
async def test_every_control_refuses_another_origin(make_node: NodeFactory,  # noqa: F811
                                                    path: str, headers: dict[str, str]) -> None:
    node = await make_node(worker=False)
    sent = {k: v.format(port=node.api.port, other=free_port()) for k, v in headers.items()}
    status, body = await post(node, path, headers=sent)
    assert status == 403, body
    assert await node.c.query.paused() == []


@pytest.mark.parametrize("path", ROUTES)
async def test_every_control_refuses_a_body_that_is_not_json(
        make_node: NodeFactory, path: str) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, body, _ = await node.request("POST", path, data=b"rule=user-stats",
                                         headers={"Content-Type": "text/plain"})
    assert status == 415, body
    status, body, _ = await node.request("POST", path, data=b"x")
    assert status == 415, body
    assert await node.c.query.paused() == []


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "cross-site"},
], ids=["other-site", "cross-site-fetch"])
async def test_the_bulk_cancel_of_schedules_refuses_another_origin(
        make_node: NodeFactory, headers: dict[str, str]) -> None:  # noqa: F811
    node = await make_node(worker=False)
    node.c.touch("stats:user:1", delay="1h")
    await node.c.flush()
    sent = {k: v.format(port=node.api.port) for k, v in headers.items()}
    status, body, _ = await node.request("DELETE", "/rules/user-stats/scheduled",
                                         params={"after": "0"}, headers=sent)
    assert status == 403, body
    assert (await node.c.query.explain("stats:user:1"))["state"] == "pending"


async def test_the_bulk_cancel_of_schedules_refuses_a_rebinding_host(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    node.c.touch("stats:user:1", delay="1h")
    await node.c.flush()
    host = f"attacker.example:{node.api.port}"
    status, _, body = await raw_http(
        node.api.port, f"DELETE /rules/user-stats/scheduled?after=0 HTTP/1.1\r\nHost: {host}\r\n")
    assert status == 421, body
    assert (await node.c.query.explain("stats:user:1"))["state"] == "pending"
