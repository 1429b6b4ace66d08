"""The key search, bulk jobs, audit log and token roles over real HTTP, on a real
server: pages by capture with a cursor, a dry run then the action, a stop after the page
under way, who did it in the audit log, a read-only token refused (403) on every action
and let in on every read, and every bad input answered 400 naming the part."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from coalescer.cli.main import main
from coalescer.store.keys import KeySpace
from coalescer.web.roles import ApiToken, TokenFileError, parse_token_file, tokens_from_env
from tests.helpers.servers import wait_until
from tests.web.test_api import TOKEN, Node, NodeFactory, make_node  # noqa: F401 (a fixture)
from tests.web.test_guards import raw_http

OPS, VIEW = "ops-secret-123", "view-secret-123"
TOKENS = [ApiToken("ops", "operator", OPS), ApiToken("viewer", "read", VIEW)]

NOW_MS = int(time.time() * 1000)  # dead letters of now: none past dead_letter_ttl


async def kill(node: Node, keys: list[str]) -> None:
    space = KeySpace(node.c.config.namespace, node.c.config.shards)
    for n, key in enumerate(keys):
        sk = space.shard(space.shard_of(key))
        await node.c.redis.hset(sk.meta, key, "D|1|1|5|boom")
        await node.c.redis.zadd(sk.dead("user-stats"), {key: NOW_MS + n})


async def finished(node: Node, job: dict[str, Any], token: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def ended() -> bool:
        status, body, _ = await node.request("GET", job["url"], token=token)
        assert status == 200, body
        found.update(body)
        return bool(body["status"] != "running")

    await wait_until(ended, timeout=20)
    return found


async def test_search_pages_by_capture_with_a_cursor(make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    keys = [f"stats:user:{n}" for n in range(20)]
    assert (await node.touch({"keys": keys}))[0] == 202
    await node.c.flush()
    status, body, _ = await node.request("GET", "/rules/user-stats/keys?where=user_id=7")
    assert status == 200 and [k["key"] for k in body["keys"]] == ["stats:user:7"]
    assert body["keys"][0]["captures"] == {"user_id": "7"} and body["state"] == "pending"
    seen: list[str] = []
    cursor = ""
    while True:
        status, body, _ = await node.request(
            "GET", "/rules/user-stats/keys", params={"limit": "6", "scan": "6",
                                                     **({"cursor": cursor} if cursor else {})})
        assert status == 200 and body["examined"] <= 6
        seen += [k["key"] for k in body["keys"]]
        if body["cursor"] is None:
            break
        cursor = body["cursor"]
    assert sorted(seen) == sorted(keys)


@pytest.mark.parametrize(("query", "status", "part", "says"), [
    ("where=user_id", 400, "where", "where 'user_id': expected CAPTURE=VALUE"),
    ("where=org=1", 400, "where", "has no capture 'org' (its captures: user_id)"),
    ("state=stuck", 400, "state", "state 'stuck': not a state; one of pending"),
    ("cursor=abc", 400, "cursor", "cursor 'abc': not a cursor"),
    ("limit=0", 400, "limit", "limit must be a whole number from 1 to 1000"),
    ("scan=x", 400, "scan", "scan must be a whole number"),
    ("colour=red", 400, "colour", "unknown query parameter 'colour'"),
])
async def test_a_bad_search_is_answered_400_naming_the_part(
        make_node: NodeFactory, query: str, status: int, part: str,  # noqa: F811
        says: str) -> None:
    node = await make_node(worker=False)
    got, body, _ = await node.request("GET", f"/rules/user-stats/keys?{query}")
    assert (got, body["part"]) == (status, part) and says in body["error"], body


async def test_an_unknown_rule_is_404(make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, body, _ = await node.request("GET", "/rules/nope/keys")
    assert status == 404 and "no rule named 'nope'" in body["error"]
    status, body, _ = await node.request("POST", "/rules/nope/bulk", json={"action": "retry"})
    assert status == 404
    status, body, _ = await node.request("GET", "/bulk/123-abc")
    assert status == 404 and "no bulk action '123-abc'" in body["error"]


async def test_a_bulk_retry_counts_then_acts_and_is_audited_with_the_token_name(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, tokens=TOKENS)
    await kill(node, [f"stats:user:{n}" for n in range(30)])
    body = {"action": "retry", "where": {"user_id": "7"}, "dry_run": True}
    status, job, _ = await node.request("POST", "/rules/user-stats/bulk", json=body, token=OPS)
    assert status == 202 and job["dry_run"] and job["state"] == "dead"
    counted = await finished(node, job, OPS)
    assert (counted["status"], counted["matched"], counted["done"]) == ("done", 1, 0)
    status, job, _ = await node.request("POST", "/rules/user-stats/bulk",
                                        json={"action": "retry"}, token=OPS)
    done = await finished(node, job, OPS)
    assert (done["status"], done["matched"], done["done"], done["who"]) == (
        "done", 30, 30, "token ops")
    status, listed, _ = await node.request("GET", "/bulk", token=VIEW)
    assert [j["id"] for j in listed["jobs"]] == [job["id"], counted["id"]]
    await node.c.audit.settle()
    status, audit, _ = await node.request("GET", "/audit?n=5", token=VIEW)
    assert status == 200
    assert [(e["action"], e["count"], e["who"], e["target"]) for e in audit["entries"]] == [
        ("retry", 30, "token ops", "the dead keys of rule user-stats")]


async def test_delete_stops_a_bulk_action_after_its_page(make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    await kill(node, [f"stats:user:{n}" for n in range(300)])
    status, job, _ = await node.request("POST", "/rules/user-stats/bulk",
                                        json={"action": "purge", "rate": 40})
    assert status == 202
    await wait_until(lambda: _done(node, job), timeout=10)
    status, stopping, _ = await node.request("DELETE", job["url"])
    assert status == 200 and (stopping["stopping"] or stopping["status"] == "aborted")
    stopped = await finished(node, job, "")
    assert stopped["status"] == "aborted" and 0 < stopped["done"] < 300
    assert (await node.c.query.status())["rules"]["user-stats"]["dead"] == 300 - stopped["done"]


async def _done(node: Node, job: dict[str, Any]) -> bool:
    _, body, _ = await node.request("GET", job["url"])
    return int(body["done"]) > 0


@pytest.mark.parametrize(("body", "part", "says"), [
    ({"action": "delete"}, "action", "no bulk action 'delete'"),
    ({"action": "retry", "state": "pending"}, "state", "retry acts on dead keys"),
    ({"action": "retry", "where": ["user_id=1"]}, "where", "where must be an object"),
    ({"action": "retry", "where": {"org": "1"}}, "where", "has no capture 'org'"),
    ({"action": "retry", "rate": -1}, "rate", "rate must be keys a second"),
    ({"action": "retry", "dry_run": "yes"}, "dry_run", "dry_run must be true or false"),
    ({"action": "retry", "colour": 1}, "colour", "unknown field 'colour'"),
])
async def test_a_bad_bulk_body_is_answered_400_naming_the_part(
        make_node: NodeFactory, body: dict[str, Any], part: str,  # noqa: F811
        says: str) -> None:
    node = await make_node(worker=False)
    status, answer, _ = await node.request("POST", "/rules/user-stats/bulk", json=body)
    assert (status, answer.get("part")) == (400, part) and says in answer["error"], answer
    _, listed, _ = await node.request("GET", "/bulk")
    assert listed["jobs"] == []


async def test_a_read_only_token_reads_everything_and_is_refused_every_action(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False, token=TOKEN, tokens=TOKENS)
    for path in ("/status", "/metrics", "/keys/stats:user:1", "/rules/user-stats/keys",
                 "/audit", "/bulk", "/history", "/due"):
        status, body, _ = await node.request("GET", path, token=VIEW)
        assert status == 200, (path, body)
    status, me, _ = await node.request("GET", "/whoami", token=VIEW)
    assert me == {"name": "viewer", "role": "read", "auth": True}
    for method, path, body in [("POST", "/touch", {"keys": ["stats:user:1"]}),
                               ("POST", "/rules/user-stats/pause", {}),
                               ("POST", "/keys/stats:user:1/run", {}),
                               ("DELETE", "/keys/stats:user:1", None),
                               ("POST", "/dead/retry", {"keys": ["stats:user:1"]}),
                               ("POST", "/rules/user-stats/bulk", {"action": "retry"}),
                               ("DELETE", "/bulk/1-x", None)]:
        status, answer, _ = await node.request(method, path, json=body, token=VIEW)
        assert status == 403, (path, answer)
        assert answer["role_needed"] == "operator" and "token 'viewer' has the read role" in (
            answer["error"])
    assert (await node.c.query.paused()) == []
    status, _, _ = await node.request("GET", "/status", token="wrong-token-1")
    assert status == 401
    status, _, _ = await node.request("POST", "/rules/user-stats/pause", json={}, token=TOKEN)
    assert status == 200  # the plain token is an operator's, as before
    status, me, _ = await node.request("GET", "/whoami", token=TOKEN)
    assert me == {"name": "token", "role": "operator", "auth": True}


async def test_without_tokens_everyone_is_an_operator(make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    status, me, _ = await node.request("GET", "/whoami")
    assert (status, me) == (200, {"name": None, "role": "operator", "auth": False})


@pytest.mark.parametrize(("text", "says"), [
    ("ops:operator", "line 1: expected name:role:secret"),
    ("# c\n\nops:admin:secret-123", "line 3: the role 'admin' of 'ops' is none of read, "
                                   "operator"),
    ("ops:read:short", "line 1: the secret of 'ops' is shorter than 8 characters"),
    ("a b:read:secret-123", "line 1: the name 'a b' must be 1 to 64 letters"),
    ("x:read:secret-123\nx:operator:secret-456", "the name 'x' is given more than once"),
    ("x:read:secret-123\ny:operator:secret-123", "two tokens have the same secret"),
])
def test_a_bad_token_file_is_refused_naming_the_line(text: str, says: str) -> None:
    with pytest.raises(TokenFileError, match=says):
        parse_token_file(text, "tokens.txt")


def test_token_file_lines_and_the_read_token_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# who:role:secret\nalice:operator:a:secret:with:colons\n")
    found = tokens_from_env({"COALESCER_TOKEN_FILE": str(path),
                             "COALESCER_READ_TOKEN": "read-only-1"})
    assert found == [ApiToken("read", "read", "read-only-1"),
                     ApiToken("alice", "operator", "a:secret:with:colons")]
    with pytest.raises(TokenFileError, match="cannot be read"):
        tokens_from_env({"COALESCER_TOKEN_FILE": str(tmp_path / "none")})


def test_run_refuses_a_bad_token_file_before_starting(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "tokens"
    bad.write_text("ops:root:secret-123\n")
    monkeypatch.setenv("COALESCER_TOKEN_FILE", str(bad))
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: r, match: 'r:{id}', handler: builtins:repr}\n")
    code = main(["run", "--rules", str(rules), "--redis", redis_url, "--http",
                 "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 1 and "line 1: the role 'root' of 'ops' is none of read, operator" in err


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:{port}", "Sec-Fetch-Site": "cross-site"},
], ids=["other-site", "cross-site-fetch"])
async def test_a_bulk_action_from_another_origin_is_refused_and_acts_on_nothing(
        make_node: NodeFactory, headers: dict[str, str]) -> None:  # noqa: F811
    node = await make_node(worker=False)
    await kill(node, ["stats:user:1"])
    sent = {k: v.format(port=node.api.port) for k, v in headers.items()}
    status, body, _ = await node.request("POST", "/rules/user-stats/bulk",
                                         json={"action": "purge"}, headers=sent)
    assert status == 403, body
    status, listed, _ = await node.request("GET", "/bulk")
    assert listed["jobs"] == []
    assert (await node.c.query.explain("stats:user:1"))["state"] == "dead"


async def test_a_bulk_action_behind_a_rebinding_host_is_refused_and_acts_on_nothing(
        make_node: NodeFactory) -> None:  # noqa: F811
    node = await make_node(worker=False)
    await kill(node, ["stats:user:1"])
    body = b'{"action": "purge"}'
    status, _, text = await raw_http(node.api.port, (
        f"POST /rules/user-stats/bulk HTTP/1.1\r\nHost: attacker.example:{node.api.port}\r\n"
        "Content-Type: application/json\r\n"), body)
    assert status == 421, text
    assert (await node.c.query.explain("stats:user:1"))["state"] == "dead"
