"""The commands printed as hints work when pasted: the node log's dead-letter line, and the
re-queue hints of `coalescer status` and `coalescer explain`, name the rules file and the
server of the process that printed them."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coalescer.store.keys import KeySpace
from tests.helpers.e2e import NodeProcs, clean_env, coalescer_cmd
from tests.helpers.inspection import fast_rules, write
from tests.helpers.servers import ValkeyProcess, poll_until

HINT = re.compile(
    r"re-queue with `(coalescer [^`]+)`(?: or `--all`)?( \(with \$COALESCER_REDIS_URL set\))?")


def cli(*args: str, cwd: Path,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*coalescer_cmd(), *args], cwd=cwd, env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=60, check=False)


def paste(hint: str, *, cwd: Path, env: dict[str, str] | None = None,
          key: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a printed `coalescer ...` command as a shell would (KEY replaced by ``key``)."""
    words = shlex.split(hint)
    assert words[0] == "coalescer", hint
    if key is not None:
        words = [key if word == "KEY" else word for word in words]
    return cli(*words[1:], cwd=cwd, env=env)


def hint_in(text: str) -> tuple[str, bool]:
    """The command of the first re-queue hint in ``text``, and whether it asks for
    $COALESCER_REDIS_URL."""
    found = HINT.search(text)
    assert found, text
    return found[1], found[2] is not None


def another_folder(tmp_path: Path) -> Path:
    """A folder of no project: no rules.yaml, no .coalescer/."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


@pytest.fixture
def conf_rules(tmp_path: Path, namespace: str) -> Path:
    """Rules in conf/ (not ./rules.yaml of the node's folder), failing bad:* at once."""
    conf = tmp_path / "conf"
    conf.mkdir()
    return write(conf, namespace, fast_rules(namespace))[0]


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(dir=tmp_path, password="s3cret-pw")
    try:
        yield server
    finally:
        server.stop()


def dead(url: str, namespace: str, key: str) -> bool:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return client.zscore(KeySpace(namespace, 1).shard(0).dead("bad"), key) is not None
    finally:
        client.close()


def dead_letter_from_node(tmp_path: Path, rules: Path, url: str, namespace: str,
                          nodes: NodeProcs) -> str:
    """Start a node on ``rules``, dead-letter bad:1; the node's log."""
    nodes.start(rules, url, "hint-node")
    touched = cli("touch", "bad:1", "--rules", str(rules), "--redis", url, cwd=tmp_path)
    assert touched.returncode == 0, touched.stderr
    return str(poll_until(lambda: "dead-lettered" in nodes.log("hint-node")
                          and nodes.log("hint-node"), timeout=30,
                          message="bad:1 dead-lettered in the node log"))


def test_the_node_logs_a_dead_letter_hint_that_works_pasted_from_another_folder(
        tmp_path: Path, conf_rules: Path, redis_url: str, namespace: str) -> None:
    elsewhere = another_folder(tmp_path)
    nodes = NodeProcs(tmp_path)
    try:
        log = dead_letter_from_node(tmp_path, conf_rules, redis_url, namespace, nodes)
        command, needs_env = hint_in(log)
        assert command == (f"coalescer dead retry --rules {conf_rules} --redis {redis_url} "
                           "bad:1") and not needs_env
        done = paste(command, cwd=elsewhere)
        assert (done.returncode, done.stdout, done.stderr) == (
            0, "re-queued 1 dead-lettered key\n", "")
        poll_until(lambda: nodes.log("hint-node").count("dead-lettered") == 2, timeout=30,
                   message="the re-queued key to run (and fail) again")
    finally:
        nodes.stop_all()
    assert not (elsewhere / ".coalescer").exists()  # no embedded server was started instead


def test_a_password_is_never_printed_the_hint_asks_for_the_environment_variable(
        tmp_path: Path, conf_rules: Path, namespace: str,
        password_server: ValkeyProcess) -> None:
    elsewhere = another_folder(tmp_path)
    nodes = NodeProcs(tmp_path)
    try:
        log = dead_letter_from_node(tmp_path, conf_rules, password_server.url, namespace, nodes)
    finally:
        nodes.stop_all()
    command, needs_env = hint_in(log)
    assert "s3cret-pw" not in log and "--redis" not in command and needs_env
    done = paste(command, cwd=elsewhere, env={"COALESCER_REDIS_URL": password_server.url})
    assert (done.returncode, done.stdout) == (0, "re-queued 1 dead-lettered key\n"), done.stderr


@pytest.mark.parametrize("env_url", [False, True])
def test_the_status_and_explain_hints_work_pasted(
        tmp_path: Path, conf_rules: Path, redis_url: str, namespace: str,
        env_url: bool) -> None:
    elsewhere = another_folder(tmp_path)
    env = {"COALESCER_REDIS_URL": redis_url} if env_url else {}
    given = () if env_url else ("--redis", redis_url)
    base = ("--rules", str(conf_rules), *given)
    nodes = NodeProcs(tmp_path)
    try:
        dead_letter_from_node(tmp_path, conf_rules, redis_url, namespace, nodes)
        for shown, key in ((cli("status", *base, cwd=tmp_path, env=env), "bad:1"),
                           (cli("explain", "bad:1", *base, cwd=tmp_path, env=env), None)):
            assert shown.returncode == 0, shown.stderr
            command, needs_env = hint_in(shown.stdout)
            assert f"--rules {conf_rules}" in command and needs_env is env_url
            assert ("--redis" in command) is not env_url
            done = paste(command, cwd=elsewhere, env=env, key=key)
            assert (done.returncode, done.stdout) == (0, "re-queued 1 dead-lettered key\n")
            poll_until(lambda: dead(redis_url, namespace, "bad:1"), timeout=30,
                       message="bad:1 dead again")
    finally:
        nodes.stop_all()

