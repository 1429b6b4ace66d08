"""Operator actions leave one INFO line naming the action, its target, how many it
changed and who: the local user for the commands (run in-process here, through the CLI's
own argument parsing), ``token`` or ``anonymous from <peer>`` over real HTTP."""

from __future__ import annotations

import getpass
import logging
import os
from pathlib import Path

import pytest

from coalescer.cli.main import main
from coalescer.common.audit_log import keys_target
from tests.cli.test_main import write_rules
from tests.web.test_api import TOKEN, NodeFactory, make_node  # noqa: F401 (a fixture)

AUDIT = "coalescer.common.audit_log"
LOCAL = f"local user {getpass.getuser()} (uid {os.getuid()})"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AUDIT]


def test_every_cli_control_logs_what_it_did_and_the_local_user(
        tmp_path: Path, namespace: str, redis_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    rules = write_rules(tmp_path, namespace, window="1h", max_wait="2h")
    common = ["--rules", str(rules), "--redis", redis_url]
    assert main(["touch", "item:1", "item:2", *common]) == 0
    assert _lines(caplog) == []  # a touch is not an operator action
    assert main(["pause", "item", *common]) == 0
    assert main(["pause", "item", *common]) == 0  # already paused: nothing changed
    assert main(["resume", "item", *common]) == 0
    assert main(["run-now", "item:1", "item:3", *common]) == 1  # item:3 is not pending
    assert main(["cancel", "item:2", *common]) == 0
    assert main(["retry", "--all", *common]) == 0  # nothing dead: nothing to do
    assert main(["dead", "purge", "--rule", "item", *common]) == 0
    assert _lines(caplog) == [
        f"operator action: pause rule item: 1 changed, by {LOCAL}",
        f"operator action: pause rule item: 0 changed, by {LOCAL}",
        f"operator action: resume rule item: 1 changed, by {LOCAL}",
        f"operator action: run-now 2 keys ('item:1', 'item:3'): 1 changed, by {LOCAL}",
        f"operator action: cancel 1 key ('item:2'): 1 changed, by {LOCAL}",
        f"operator action: retry every dead key: 0 changed, by {LOCAL}",
        f"operator action: dead purge every dead key of rule item: 0 changed, by {LOCAL}",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == AUDIT)


@pytest.mark.parametrize("token", [None, TOKEN])
async def test_every_http_control_logs_what_it_did_and_who(
        make_node: NodeFactory, caplog: pytest.LogCaptureFixture,  # noqa: F811
        token: str | None) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    node = await make_node(worker=False, token=token)
    assert (await node.touch({"keys": ["stats:user:1", "stats:user:2"]}, token=token))[0] == 202
    await node.c.flush()
    for method, path in [("POST", "/rules/user-stats/pause"),
                         ("POST", "/rules/user-stats/resume"),
                         ("POST", "/keys/stats:user:1/run"),
                         ("DELETE", "/keys/stats:user:2"),
                         ("POST", "/dead/retry")]:
        body = {"keys": ["stats:user:9"]} if path == "/dead/retry" else {}
        status, answer, _ = await node.request(method, path, json=body, token=token)
        assert status == 200, answer
    who = "token" if token else "anonymous from 127.0.0.1"
    assert _lines(caplog) == [
        f"operator action: pause rule user-stats: 1 changed, by {who}",
        f"operator action: resume rule user-stats: 1 changed, by {who}",
        f"operator action: run-now 1 key ('stats:user:1'): 1 changed, by {who}",
        f"operator action: cancel 1 key ('stats:user:2'): 1 changed, by {who}",
        f"operator action: retry 1 key ('stats:user:9'): 0 changed, by {who}",
    ]


def test_a_target_escapes_control_characters_and_names_at_most_five_keys() -> None:
    assert keys_target(["a\nb", "c\x1b[2J"]) == "2 keys ('a\\x0ab', 'c\\x1b[2J')"
    assert keys_target([f"k:{i}" for i in range(7)]) == (
        "7 keys ('k:0', 'k:1', 'k:2', 'k:3', 'k:4' and 2 more)")
    assert keys_target(None, rule="r\n") == "every dead key of rule r\\x0a"
