"""What the command line says: one clear line for a bad --redis or --http, a loud
warning for an API open to the network, nothing on stderr when a one-shot command
succeeds, --json answers, --version, and a status that summarises its shards."""

from __future__ import annotations

import asyncio
import errno
import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import coalescer
from coalescer import Coalescer
from coalescer.cli.commands import bind_problem
from coalescer.store.embedded import EmbeddedServer
from coalescer.store.keys import KeySpace
from coalescer.web.guards import is_loopback
from tests.helpers.e2e import REPO, clean_env, coalescer_cmd
from tests.helpers.inspection import fast_rules, node, write
from tests.helpers.servers import wait_until


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*coalescer_cmd(), *args], cwd=cwd, env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout, check=False)


async def acli(*args: str, cwd: Path) -> tuple[int, str, str]:
    """``cli`` without blocking the event loop (a node runs in this process)."""
    proc = await asyncio.create_subprocess_exec(
        *coalescer_cmd(), *args, cwd=cwd, env=clean_env(), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def rules(tmp_path: Path, namespace: str) -> Path:
    return write(tmp_path, namespace, fast_rules(namespace))[0]


# -- a bad --redis ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["touch", "ok:1"], ["status"], ["run", "--http", "off"],
                                     ["dead", "list"], ["explain", "ok:1"]])
def test_a_redis_address_without_a_scheme_is_one_line_saying_what_to_write(
        tmp_path: Path, rules: Path, command: list[str]) -> None:
    done = cli(*command, "--rules", str(rules), "--redis", "localhost:6379", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (f"coalescer {command[0]}: --redis: 'localhost:6379' is not a Redis "
                           "URL; write redis://localhost:6379/0\n")


@pytest.mark.parametrize(("value", "says"), [
    ("localhost", "'localhost' is not a Redis URL; write redis://localhost:6379/0"),
    (":pw@db:6380", "':***@db:6380' is not a Redis URL; write redis://:***@db:6380/0"),
    ("http://db:6379", "'http://db:6379' is not a Redis URL; write redis://HOST:PORT/0"),
    ("redis://db:port/0", "'redis://db:port/0' is not a usable Redis URL: Port could not"),
])
def test_other_unusable_redis_urls(tmp_path: Path, rules: Path, value: str, says: str) -> None:
    done = cli("status", "--rules", str(rules), "--redis", value, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(f"coalescer status: --redis: {says}"), done.stderr
    assert done.stderr.count("\n") == 1 and "pw" not in done.stderr
    from_env = cli("touch", "ok:1", "--rules", str(rules), cwd=tmp_path,
                   env={"COALESCER_REDIS_URL": value})
    assert from_env.stderr.startswith(f"coalescer touch: $COALESCER_REDIS_URL: {says}")
    assert not (tmp_path / ".coalescer").exists()  # no embedded server was started instead


@pytest.mark.parametrize("password", ["Xq/Zk9w", "Xq#Zk9w", "Xq?Zk9w", "Xq Zk9w", "Xq'Zk9w"])
def test_a_password_with_an_unencoded_character_is_never_printed(
        tmp_path: Path, rules: Path, password: str) -> None:
    value = f"redis://:{password}@127.0.0.1:6379/0"
    done = cli("status", "--rules", str(rules), "--redis", value, cwd=tmp_path)
    assert done.returncode == 1
    assert "is not a usable Redis URL" in done.stderr or "could not connect" in done.stderr
    assert "Xq" not in done.stderr and "Zk9w" not in done.stderr  # no piece of it either
    assert "redis://:***@127.0.0.1:6379/0" in done.stderr


@pytest.mark.parametrize("url", ["unix://:Xq/Zk9w/Tail@{sock}", "unix://:Xq/Zk9w/Tail@{sock}?db=0",
                                 "unix://{sock}?password=Xq/Zk9w#Tail",
                                 "unix://{sock}?password=Xq@Zk9w/Tail"])
def test_a_unix_socket_password_with_an_unencoded_character_is_never_printed(
        tmp_path: Path, rules: Path, url: str) -> None:
    value = url.format(sock=tmp_path / "missing.sock")
    done = cli("status", "--rules", str(rules), "--redis", value, cwd=tmp_path)
    assert done.returncode == 1
    assert "could not connect to unix://" in done.stderr, done.stderr
    assert "Zk9w" not in done.stderr and "Tail" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["touch", "ok:1"], ["status"], ["run", "--http", "off"]])
def test_nothing_listening_is_one_line_naming_the_url_without_its_password(
        tmp_path: Path, rules: Path, command: list[str]) -> None:
    for url, shown in (("redis://127.0.0.1:1", "redis://127.0.0.1:1"),
                       ("redis://:hunter2@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0")):
        done = cli(*command, "--rules", str(rules), "--redis", url, cwd=tmp_path)
        assert done.returncode == 1
        assert done.stderr == (f"coalescer {command[0]}: could not connect to {shown} (from "
                               "--redis): connection refused (is a Redis server listening "
                               "there?)\n")


# -- --http -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "8470", "localhost:http", "127.0.0.1:70000"])
def test_a_bad_http_address_is_named_once(tmp_path: Path, rules: Path, value: str) -> None:
    done = cli("run", "--http", value, "--rules", str(rules), "--redis", "redis://127.0.0.1:1",
               cwd=tmp_path)  # refused before any connection
    assert done.returncode == 1
    assert done.stderr == (f"coalescer run: --http wants HOST:PORT or 'off' (PORT 0 to "
                           f"65535), not {value!r}\n")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port held by a loopback listener: binding it on every interface fails, so the
    API is never actually open to the network in this test."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_an_api_open_to_the_network_on_purpose_is_a_loud_warning(
        tmp_path: Path, rules: Path, redis_url: str, taken_port: int) -> None:
    args = ("run", "--http", f"0.0.0.0:{taken_port}", "--rules", str(rules),
            "--redis", redis_url)
    done = cli(*args, "--insecure-no-token", cwd=tmp_path)
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, done.stderr
    assert f"the HTTP API on http://0.0.0.0:{taken_port} has no token: it is open to the " \
           "network" in warnings[0]
    assert "set COALESCER_TOKEN=<secret>" in warnings[0]
    assert done.returncode == 1  # and the port was taken: one line says so
    assert done.stderr.splitlines()[-1] == (
        f"coalescer run: --http 0.0.0.0:{taken_port}: the address is in use (another node "
        "on this machine?); pass another --http HOST:PORT, or --http off")

    with_token = cli(*args, cwd=tmp_path, env={"COALESCER_TOKEN": "s3cret"})
    assert with_token.returncode == 1
    assert " WARNING " not in with_token.stderr


def test_a_taken_http_port_is_one_line_saying_what_to_pass_instead(
        tmp_path: Path, rules: Path, redis_url: str, taken_port: int) -> None:
    done = cli("run", "--http", f"127.0.0.1:{taken_port}", "--rules", str(rules),
               "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"coalescer run: --http 127.0.0.1:{taken_port}: the address is in use (another node "
        "on this machine?); pass another --http HOST:PORT, or --http off")
    assert "Errno" not in done.stderr and "Traceback" not in done.stderr


def test_an_http_address_of_no_interface_here_is_one_line(
        tmp_path: Path, rules: Path, redis_url: str) -> None:
    done = cli("run", "--http", "192.0.2.1:8470", "--rules", str(rules), "--redis", redis_url,
               cwd=tmp_path, env={"COALESCER_TOKEN": "s3cret"})  # TEST-NET-1: never local
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "coalescer run: --http 192.0.2.1:8470: no network interface of this machine has that "
        "address; pass another --http HOST:PORT, or --http off")


@pytest.mark.parametrize(("error", "says"), [
    (OSError(errno.EACCES, "Permission denied"),
     "permission denied (ports below 1024 need privileges)"),
    (OSError(errno.EADDRINUSE, "in use"), "the address is in use (another node on this machine?)"),
    (socket.gaierror(-2, "Name or service not known"),
     "cannot listen there (Name or service not known)"),
])
def test_each_reason_an_address_cannot_be_bound_reads_plainly(error: OSError, says: str) -> None:
    # a privileged port cannot fail for root, nor a name lookup without a resolver: made up
    assert bind_problem(error) == says


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False),
    ("", False), ("10.0.0.5", False), ("example.com", False)])
def test_which_binds_stay_on_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# -- quiet on success, --json, --version ----------------------------------------------------


async def _make_dead(rules: Path, redis_url: str) -> None:
    async with node(rules, redis_url) as c:
        c.touch_many(["bad:1", "bad:2"])
        await wait_until(lambda: _dead(c, 2), message="two dead letters")


async def _dead(c: Coalescer, n: int) -> bool:
    return sum(int(r["dead"]) for r in (await c.query.status())["rules"].values()) == n


def test_one_shot_commands_print_their_answer_and_nothing_on_stderr(
        tmp_path: Path, rules: Path, redis_url: str) -> None:
    asyncio.run(_make_dead(rules, redis_url))
    base = ("--rules", str(rules), "--redis", redis_url)
    answers = {
        ("touch", "ok:1"): "touched 1 key\n",
        ("touch", "ok:1", "ok:2", "ok:3"): "touched 3 keys\n",
        ("retry", "bad:1"): "re-queued 1 dead-lettered key\n",
        ("dead", "purge", "--all"): "re-queued 1 dead-lettered key\n".replace(
            "re-queued", "purged"),
    }
    for command, answer in answers.items():
        done = cli(*command, *base, cwd=tmp_path)
        assert (done.returncode, done.stdout, done.stderr) == (0, answer, ""), command
    for command in (["status"], ["dead", "list"], ["explain", "ok:1"], ["history"]):
        done = cli(*command, *base, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout and done.stderr == "", command
    loud = cli("touch", "ok:1", *base, "-v", cwd=tmp_path)
    assert loud.returncode == 0 and "using redis://127.0.0.1:" in loud.stderr


def test_json_answers(tmp_path: Path, rules: Path, redis_url: str) -> None:
    asyncio.run(_make_dead(rules, redis_url))
    base = ("--rules", str(rules), "--redis", redis_url)

    def answer(*command: str, code: int = 0) -> object:
        done = cli(*command, *base, "--json", cwd=tmp_path)
        assert done.returncode == code, done.stderr
        return json.loads(done.stdout)

    assert answer("touch", "ok:1", "ok:2") == {"touched": 2}
    assert answer("retry", "bad:1", "ok:1", code=1) == {"requeued": 1, "not_dead": ["ok:1"]}
    assert answer("dead", "retry", "bad:1", code=1) == {"requeued": 0, "not_dead": ["bad:1"]}
    assert answer("dead", "purge", "bad:2") == {"purged": 1, "not_dead": []}
    assert answer("status")["rules"]["ok"]["pending"] >= 2  # type: ignore[index]


def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version
    done = cli("--version", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, f"coalescer {version('coalescer')}\n")
    assert re.fullmatch(r"coalescer \d+\.\d+\.\d+\n", done.stdout)
    assert coalescer.__version__ == version("coalescer")


# -- status: a summary of the shards -----------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2000])
async def test_status_summarises_shards_and_lists_them_on_request(
        tmp_path: Path, redis_url: str, namespace: str, shards: int) -> None:
    # a long leader lease: a loaded machine must not let a lease lapse mid-test
    text = fast_rules(namespace, shards=shards).replace("claim_lease: 5s",
                                                        "claim_lease: 5s\nleader_lease: 30s")
    rules, _ = write(tmp_path, namespace, text)
    base = ("--rules", str(rules), "--redis", redis_url)
    code, out, _ = await acli("status", *base, cwd=tmp_path)  # before any node ran
    unled = "0" if shards == 1 else f"0-{shards - 1}"
    assert f"shards: {shards} — no leader anywhere; unled: {unled}" in out.splitlines()
    async with node(rules, redis_url, node_id="node-a") as c:
        await wait_until(lambda: len(c.leads()) == shards, timeout=60,
                         message=f"node-a leading all {shards} shards")
        code, out, err = await acli("status", *base, cwd=tmp_path)
        assert (code, err) == (0, "")
        assert f"shards: {shards} — node-a leads {shards}; unled: none" in out.splitlines()
        assert len(out.splitlines()) < 20
        code, out, _ = await acli("status", "--json", *base, cwd=tmp_path)
        rows = json.loads(out)["shards"]
        assert [(r["shard"], r["leader"]) for r in rows] == [(i, "node-a") for i in range(shards)]
        code, out, _ = await acli("status", "--shards", *base, cwd=tmp_path)
        assert f"{shards - 1:<6} node-a" in out.splitlines()
        assert len(out.splitlines()) > shards



def test_counts_read_as_english(tmp_path: Path, rules: Path, redis_url: str) -> None:
    asyncio.run(_make_dead(rules, redis_url))  # attempts: 1
    base = ("--rules", str(rules), "--redis", redis_url)
    listed = cli("dead", "list", *base, cwd=tmp_path).stdout
    assert listed.startswith("showing 2 of 2 dead letters")
    assert "] after 1 attempt: RuntimeError: no such user: bad:1" in listed
    assert "after 1 attempt: RuntimeError" in cli("status", *base, cwd=tmp_path).stdout
    assert "after 1 attempt: RuntimeError" in cli("explain", "bad:1", *base, cwd=tmp_path).stdout
    assert cli("dead", "purge", "bad:1", *base, cwd=tmp_path).stdout == (
        "purged 1 dead-lettered key\n")
    assert "showing 1 of 1 dead letter " in cli("dead", "list", *base, cwd=tmp_path).stdout


# -- demo: a namespace of its own each run -------------------------------------------------------


def _refreshes(stdout: str) -> str:
    [line] = [line for line in stdout.splitlines() if line.startswith("refreshes: ")]
    return line


@pytest.mark.slow  # some 7-10 s: with the long scenarios, out of the quick run
def test_demo_tells_the_same_story_every_run_and_leaves_no_keys(tmp_path: Path) -> None:
    shutil.copy(REPO / "rules.yaml", tmp_path / "rules.yaml")
    shutil.copytree(REPO / "examples", tmp_path / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    first = cli("demo", cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    # keys left pending in the rules' own namespace (a write path ran here meanwhile)
    touched = cli("touch", "stats:user:1", "stats:user:2", "stats:org:9", cwd=tmp_path)
    assert touched.returncode == 0, touched.stderr
    second = cli("demo", cwd=tmp_path, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _refreshes(first.stdout) == _refreshes(second.stdout)
    assert _refreshes(first.stdout).startswith("refreshes: 52 for ")
    spaces = [re.search(r"namespace (demo-[0-9a-f]{8}) ", done.stdout) for done in (first, second)]
    assert spaces[0] and spaces[1] and spaces[0][1] != spaces[1][1]

    server = EmbeddedServer(tmp_path / ".coalescer")
    client = redis.Redis.from_url(server.acquire(), decode_responses=True)
    try:
        assert client.keys("demo-*") == []  # each run deleted its keys
        meta = KeySpace("coalescer", 1).shard(0).meta
        assert sorted(client.hkeys(meta)) == ["stats:org:9", "stats:user:1", "stats:user:2"]
    finally:
        client.close()
        server.release()


def test_the_package_is_mit_licensed() -> None:
    from importlib.metadata import metadata
    assert metadata("coalescer")["License-Expression"] == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the coalescer authors\n")
