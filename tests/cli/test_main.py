"""The `coalescer` command line, run as a real child process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from coalescer import Coalescer
from coalescer.cli.main import main
from coalescer.cli.parser import build_parser
from coalescer.store.keys import KeySpace
from tests.helpers.e2e import (
    REPO,
    NodeProcs,
    clean_env,
    coalescer_cmd,
    leader_node,
    line_rules,
    read_lines,
)
from tests.helpers.servers import ValkeyProcess, poll_until, wait_until

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 1s
defaults:
  window: 100ms
  max_wait: 2s
  absorb: 10ms
  retry: {{attempts: 1, backoff: 20ms, max_backoff: 50ms}}
rules:
  - name: item
    match: "item:{{id}}"
    window: {window}
    max_wait: {max_wait}
    handler: {{mod}}:{handler}
  - name: other
    match: "other:*"
    handler: {{mod}}:refresh
"""


def cli(*args: str, cwd: Path, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*coalescer_cmd(), *args], cwd=cwd, env=clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout, check=False)


def write_rules(tmp_path: Path, namespace: str, *, window: str = "100ms",
                max_wait: str = "2s", handler: str = "refresh") -> Path:
    return line_rules(tmp_path, f"cli_{namespace}", RULES.format(
        ns=namespace, window=window, max_wait=max_wait, handler=handler))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def valkey_servers_under(folder: Path) -> list[int]:
    """Pids of live valkey-server processes whose working directory is under ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if b"valkey-server" in cmdline and cwd.is_relative_to(folder) and state not in "ZX":
            found.append(int(entry.name))
    return found


# -- check --------------------------------------------------------------------------------


def test_check_prints_the_rules(tmp_path: Path, namespace: str) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("check", str(rules), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout
    assert "item" in done.stdout
    assert "item:{id}" in done.stdout
    assert "other:*" in done.stdout
    assert "window: 100ms" in done.stdout


def test_check_a_bad_file_names_file_line_and_field(tmp_path: Path, namespace: str) -> None:
    rules = write_rules(tmp_path, namespace)
    text = rules.read_text().replace("    window: 100ms\n", "    windw: 100ms\n", 1)
    rules.write_text(text)
    line = text.splitlines().index("    windw: 100ms") + 1
    done = cli("check", str(rules), cwd=tmp_path)
    assert done.returncode == 1
    assert f"{rules}:{line}" in done.stderr
    assert "windw" in done.stderr
    # the default path is ./rules.yaml
    done = cli("check", cwd=tmp_path)
    assert done.returncode == 1
    assert f"rules.yaml:{line}" in done.stderr


HOSTILE_FILES = {
    # name: (make the path in tmp_path, what stderr says after "PATH:")
    "deeply nested": (lambda p: p.write_bytes(b"rules: " + b"[" * 20000 + b"]" * 20000),
                      "1: values are nested more than 50 deep"),
    "billion laughs": (lambda p: p.write_text("".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else '1'] * 10)}]\n" for i in range(10))),
        "6: the file holds more than 250000 values"),
    "NUL byte": (lambda p: p.write_bytes(b"rules:\n  - name: a\x00\n"),
                 "2: character U+0000 is not allowed"),
    "not UTF-8": (lambda p: p.write_bytes(b"rules:\n  - name: caf\xe9\n"),
                  "2: byte 0xe9 in column 14 is not UTF-8"),
    "binary": (lambda p: p.write_bytes(bytes(range(128, 256)) * 100), "1: byte 0x80"),
    "tabs": (lambda p: p.write_bytes(b"rules:\n\t- name: a\n"), "2: YAML syntax error"),
    "top-level list": (lambda p: p.write_text("- rules\n"),
                       "1: the top level must be a mapping, got a list"),
    "empty": (lambda p: p.write_text(""), " the file is empty"),
    "directory": (lambda p: p.mkdir(), " is a directory, not a rules file"),
    "missing": (lambda p: None, " rules file not found"),
    "huge": (lambda p: p.write_text("#" * 50_000_000), " rules file is larger than 1024 KiB"),
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_check_says_what_is_wrong_in_one_line(tmp_path: Path, name: str) -> None:
    make, says = HOSTILE_FILES[name]
    path = tmp_path / "rules.yaml"
    make(path)
    done = cli("check", str(path), cwd=tmp_path, timeout=30)
    assert done.returncode == 1
    assert done.stdout == ""
    error, count = done.stderr.splitlines()  # one line each: no traceback, no excerpt
    assert error.startswith(f"{path}:{says}"), done.stderr
    assert count == f"1 error in {path}"


MANY_ERRORS = """\
defaults:
  window: -5
rules:
  - name: item
    match: "item:{{id}}"
    handler: {mod}:refresh
    timeout: "-2s"
  - name: item
    match: "other:*"
    handler: {mod}:refresh
"""


def test_check_reports_every_error_then_a_count(tmp_path: Path) -> None:
    rules = line_rules(tmp_path, f"cli_{tmp_path.name}", MANY_ERRORS.format(mod="{mod}"))
    done = cli("check", str(rules), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert [line.split(": ")[:2] for line in lines[:-1]] == [
        [f"{rules}:2", "defaults.window"], [f"{rules}:7", "rules[0].timeout"],
        [f"{rules}:8", "rules[1].name"]]
    assert "negative duration -5" in lines[0]
    assert "negative duration '-2s'" in lines[1]
    assert "duplicate rule name 'item'" in lines[2]
    assert lines[-1] == f"3 errors in {rules}"



def test_check_json_lists_every_error_and_warning(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rules = line_rules(tmp_path, f"cli_{tmp_path.name}", MANY_ERRORS.format(mod="{mod}"))
    assert main(["check", str(rules), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["rules"] == []
    assert [(e["line"], e["field"]) for e in report["errors"]] == [
        (2, "defaults.window"), (7, "rules[0].timeout"), (8, "rules[1].name")]
    good = tmp_path / "good.yaml"
    good.write_text("rules:\n  - {name: any, match: 'item:*', handler: 'json:dumps'}\n"
                    "  - {name: item, match: 'item:{id}', handler: 'json:dumps'}\n")
    assert main(["check", str(good), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["errors"] == []
    assert [(w["line"], w["field"]) for w in report["warnings"]] == [(3, "rules[1].match")]
    assert report["rules"] == [{"name": "any", "match": "item:*"},
                               {"name": "item", "match": "item:{id}"}]


SIGNATURE_HANDLERS = """\
def refresh():
    pass

def ok(claim):
    pass
"""


def test_check_refuses_a_handler_that_cannot_take_the_claim(tmp_path: Path) -> None:
    (tmp_path / "sigs_cli.py").write_text(SIGNATURE_HANDLERS)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: a\n    match: 'a:*'\n    handler: sigs_cli:refresh\n"
                     "  - name: b\n    match: 'b:*'\n    handler: sigs_cli:ok\n")
    done = cli("check", cwd=tmp_path)  # ./rules.yaml by default, its default settings
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "./rules.yaml:4: rules[0].handler: sigs_cli:refresh takes 0 positional arguments; "
        "a handler takes one (the claim)",
        "1 error in ./rules.yaml"]


def test_check_warns_and_still_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLI_HOOK_SECRET", raising=False)
    rules = tmp_path / "rules.yaml"
    rules.write_text("""\
rules:
  - {name: any-item, match: "item:*", handler: "json:dumps"}
  - {name: item, match: "item:{id}", handler: "json:dumps"}
  - name: hook
    match: "hook:{id}"
    handler: {http: {url: "http://127.0.0.1:9/{id}", secret_env: CLI_HOOK_SECRET}}
""")
    assert main(["check", str(rules)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith(
        f"{rules}:3: rules[1].match: warning: rule 'item' can never match: every key its "
        "pattern 'item:{id}' matches is matched first by rules[0] 'any-item'")
    assert err.splitlines()[1].startswith(
        f"{rules}:6: rules[2].handler.http.secret_env: warning: environment variable "
        "CLI_HOOK_SECRET is not set")
    assert len(err.splitlines()) == 2
    assert out.startswith(f"{rules}: OK (2 warnings)\n")
    monkeypatch.setenv("CLI_HOOK_SECRET", "s3cret")
    assert main(["check", str(rules)]) == 0
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and "can never match" in err
    assert "s3cret" not in out + err


def test_check_and_a_worker_name_a_handler_that_does_not_import(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    """The handler's module is not next to the rules: a writer touches all the same
    (it never imports handlers); check and a worker node refuse, naming where."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"namespace: {namespace}\nrules:\n  - name: item\n    match: 'item:{{id}}'"
                     "\n    handler: cli_workers_only.stats:refresh\n")
    done = cli("touch", "item:1", "--rules", str(rules), "--redis", redis_url, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert r.zscore(KeySpace(namespace, 1).shard(0).due("item"), "item:1") is not None
    done = cli("status", "--json", "--rules", str(rules), "--redis", redis_url, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rules"]["item"]["pending"] == 1

    done = cli("check", str(rules), cwd=elsewhere)
    assert done.returncode == 1
    first, count = done.stderr.splitlines()
    assert first.startswith(f"{rules}:5: rules[0].handler: handler module "
                            "'cli_workers_only.stats' does not import")
    assert count == f"1 error in {rules}"
    done = cli("run", "--http", "off", "--rules", str(rules), "--redis", redis_url,
               cwd=elsewhere)
    assert done.returncode == 1
    assert done.stderr.startswith(f"coalescer run: {rules}:5: rules[0].handler: handler module")
    assert done.stderr.count("\n") == 1


def test_run_refuses_to_start_without_a_webhook_secret(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"""\
namespace: {namespace}
rules:
  - name: org-stats
    match: "stats:org:{{org_id}}"
    handler:
      http:
        url: "http://127.0.0.1:9/refresh/{{org_id}}"
        secret_env: CLI_UNSET_SECRET_{namespace}
""")
    done = cli("run", "--http", "off", "--rules", str(rules), "--redis", redis_url,
               cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        f"coalescer run: {rules}:8: rules[0].handler.http.secret_env: rule 'org-stats' signs "
        f"its webhook with the environment variable CLI_UNSET_SECRET_{namespace}, which is not "
        "set (or empty); every refresh of that rule would fail and be dead-lettered: set it, "
        "or remove secret_env\n")
    assert r.keys(f"{namespace}*") == []  # never joined: no lease, no registry entry
    empty = cli("run", "--http", "off", "--rules", str(rules), "--redis", redis_url,
                cwd=tmp_path, env={f"CLI_UNSET_SECRET_{namespace}": ""})
    assert empty.returncode == 1 and "not set (or empty)" in empty.stderr


@pytest.mark.parametrize(("args", "value"), [
    (["--grace", "-5"], "-5"), (["--grace", "-0.5"], "-0.5"), (["--grace", "soon"], "soon"),
    (["--grace", "nan"], "nan"), (["--grace", "inf"], "inf"), (["--grace=-2s"], "-2s")])
def test_run_refuses_a_bad_grace(args: list[str], value: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "coalescer run: error: argument --grace: must be a number of seconds of 0 or more "
        f"(or 30s, 2m), not {value!r}")


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("1.5", 1.5), ("2m", 120.0)])
def test_run_accepts_a_grace(value: str, seconds: float) -> None:
    assert build_parser().parse_args(["run", "--grace", value]).grace == seconds
    assert build_parser().parse_args(["run"]).grace == 30.0


# -- touch ----------------------------------------------------------------------------------


def test_touch_exits_once_redis_holds_the_key(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("touch", "item:1", "other:a:b", "--rules", str(rules), "--redis", redis_url,
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sk = KeySpace(namespace, 1).shard(0)
    assert r.zscore(sk.due("item"), "item:1") is not None
    assert r.zscore(sk.due("other"), "other:a:b") is not None


def test_touch_of_an_unknown_key_exits_2_and_touches_nothing(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace)
    done = cli("touch", "item:1", "nope:1", "item:2", "--rules", str(rules),
               "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 2
    assert "nope:1" in done.stderr
    assert r.keys(f"{namespace}:*") == []


# -- status, retry --------------------------------------------------------------------------


def test_status_names_the_running_node(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace, window="30s", max_wait="60s")
    node_id = f"node-{namespace}"
    nodes = NodeProcs(tmp_path)
    try:
        nodes.start(rules, redis_url, node_id, E2E_LOG=str(tmp_path / "refreshes.log"))
        sk = KeySpace(namespace, 1).shard(0)
        poll_until(lambda: leader_node(r.get(sk.leader)) == node_id, timeout=20,
                   message=f"{node_id} leading; its log:\n{nodes.log(node_id)}")
        assert cli("touch", "item:1", "item:2", "--rules", str(rules), "--redis", redis_url,
                   cwd=tmp_path).returncode == 0

        done = cli("status", "--json", "--rules", str(rules), "--redis", redis_url,
                   cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["shards"][0]["shard"] == 0
        assert status["shards"][0]["leader"] == node_id
        assert status["rules"]["item"] | {"pending": 2, "in_flight": 0, "dead": 0} \
            == status["rules"]["item"]
        assert {"pending", "in_flight", "dead"} <= set(status["rules"]["other"])

        table = cli("status", "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        assert node_id in table.stdout
        assert "item" in table.stdout
        assert "PENDING" in table.stdout.upper()
    finally:
        nodes.stop_all()


async def test_retry_requeues_dead_keys(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace, handler="fail")  # attempts: 1
    sk = KeySpace(namespace, 1).shard(0)
    async with Coalescer.from_yaml(rules, redis_url=redis_url, node_id="w", grace=2) as c:
        for key in ("item:1", "item:2", "item:3"):
            c.touch(key)
        await c.flush()
        await wait_until(lambda: r.zcard(sk.dead("item")) == 3, message="three dead keys")

    args = ("--rules", str(rules), "--redis", redis_url)
    status = json.loads(cli("status", "--json", *args, cwd=tmp_path).stdout)
    assert status["rules"]["item"]["dead"] == 3
    assert any("refresh failed on purpose" in d["error"] for d in status["dead_letters"])

    done = cli("retry", "item:1", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1" in done.stdout
    assert r.zscore(sk.due("item"), "item:1") is not None
    assert r.zcard(sk.dead("item")) == 2

    done = cli("retry", "--all", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2" in done.stdout
    assert r.zcard(sk.dead("item")) == 0
    assert r.zcard(sk.due("item")) == 3
    status = json.loads(cli("status", "--json", *args, cwd=tmp_path).stdout)
    assert status["rules"]["item"] | {"pending": 3, "dead": 0} == status["rules"]["item"]

    assert cli("retry", *args, cwd=tmp_path).returncode == 1  # neither KEYs nor --all


# -- cancel -----------------------------------------------------------------------------------


async def test_cancel_drops_pending_keys_and_names_those_that_were_not(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace, window="30s", max_wait="60s")
    sk = KeySpace(namespace, 1).shard(0)
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as c:
        c.touch_many(["item:1", "item:2", "item:3", "other:a"])
        await c.flush()
    args = ("--rules", str(rules), "--redis", redis_url)

    done = cli("cancel", "item:1", "other:a", "--json", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"cancelled": ["item:1", "other:a"], "not_pending": [],
                                       "states": {"item:1": "pending", "other:a": "pending"}}
    assert r.zrange(sk.due("item"), 0, -1) == ["item:2", "item:3"]

    done = cli("cancel", "item:1", "item:2", "item:9", *args, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout.strip() == "cancelled 1 key"
    assert [line.split(" is not pending")[0] for line in done.stderr.splitlines()] == [
        "coalescer cancel: 'item:1'", "coalescer cancel: 'item:9'"]
    assert "idle" in done.stderr
    assert r.zrange(sk.due("item"), 0, -1) == ["item:3"]

    done = cli("history", "--key", "item:2", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split()[3:5] == ["cancelled", "item"]
    done = cli("explain", "item:2", *args, cwd=tmp_path)
    assert "cancelled by node" in done.stdout


def test_cancel_of_a_key_no_rule_matches_exits_2_and_cancels_nothing(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace, window="30s", max_wait="60s")
    args = ("--rules", str(rules), "--redis", redis_url)
    assert cli("touch", "item:1", *args, cwd=tmp_path).returncode == 0

    done = cli("cancel", "item:1", "nope:1", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert "no rule" in done.stderr
    assert "'nope:1'" in done.stderr
    assert "nothing was cancelled" in done.stderr
    too_long = cli("cancel", "item:" + "x" * 1100, *args, cwd=tmp_path)
    assert too_long.returncode == 2  # a key Redis cannot store
    assert "cannot be stored" in too_long.stderr
    sk = KeySpace(namespace, 1).shard(0)
    assert r.zscore(sk.due("item"), "item:1") is not None


def test_cancel_of_a_running_key_with_nothing_queued_says_so(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = write_rules(tmp_path, namespace, window="30s", max_wait="60s")
    sk = KeySpace(namespace, 1).shard(0)
    r.hset(sk.meta, "item:1", "R|7|1000|1000|1|1100||||elsewhere")  # claimed by a node
    r.zadd(sk.inflight("item"), {"item:1": 2**40})
    done = cli("cancel", "item:1", "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 1
    assert "running with nothing queued after it" in done.stderr
    assert r.hget(sk.meta, "item:1") == "R|7|1000|1000|1|1100||||elsewhere"


# -- the embedded server ----------------------------------------------------------------------


def test_demo_runs_on_the_embedded_server(tmp_path: Path) -> None:
    done = cli("demo", cwd=tmp_path, timeout=90)  # an empty folder: the demo's own rules
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refreshes:" in done.stdout
    assert "touches" in done.stdout
    root = tmp_path / ".coalescer"
    assert (root / "data").is_dir()  # the embedded server ran with its data here
    assert not (root / "server.json").exists()  # and was stopped afterwards
    assert valkey_servers_under(root) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".coalescer"]


def test_demo_runs_the_rules_given_with_rules(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples", project / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "rules.yaml", project / "rules.yaml")
    done = cli("demo", "--rules", "project/rules.yaml", cwd=tmp_path, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rules project/rules.yaml, namespace demo-" in done.stdout
    assert "refreshes: 52 for " in done.stdout
    assert (project / ".coalescer" / "data").is_dir()  # beside the rules file, as elsewhere
    missing = cli("demo", "--rules", "nowhere.yaml", cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.startswith("coalescer demo: nowhere.yaml: rules file not found")


def test_commands_share_the_embedded_server_when_no_redis_is_given(
        tmp_path: Path, namespace: str) -> None:
    rules = write_rules(tmp_path, namespace, window="30s", max_wait="60s")
    root = tmp_path / ".coalescer"
    done = cli("touch", "item:1", "--rules", str(rules), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (root / "data").is_dir()
    assert not (root / "server.json").exists()
    assert valkey_servers_under(root) == []

    # the next command in the same folder finds the touch (the data is kept, AOF on)
    done = cli("status", "--json", "--rules", str(rules), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rules"]["item"]["pending"] == 1
    assert valkey_servers_under(root) == []


# -- one embedded server per project, whatever the working folder ----------------------------


def start_node(folder: Path, *args: str, env: dict[str, str] | None = None,
               name: str = "node") -> tuple[subprocess.Popen[bytes], Path]:
    """A `coalescer run` child in ``folder``; its stdout and stderr go to NAME.out."""
    out_path = folder / f"{name}.out"
    with out_path.open("ab") as out:
        proc = subprocess.Popen([*coalescer_cmd(), "run", "--http", "off", *args], cwd=folder,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env or clean_env())
    return proc, out_path


def stop_node(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def refreshed(log: Path, key: str) -> bool:
    return any(phase == "done" and k == key for phase, _, k, _, _ in read_lines(log))


def test_commands_from_a_subfolder_reach_the_projects_embedded_server(
        tmp_path: Path, namespace: str) -> None:
    write_rules(tmp_path, namespace)  # ./rules.yaml, the default --rules of `run`
    log = tmp_path / "refreshes.log"
    node, out = start_node(tmp_path, "--node-id", "n1",
                           env=clean_env(E2E_NODE="n1", E2E_LOG=str(log)))
    try:
        banner = poll_until(lambda: "running" in out.read_text() and out.read_text(),
                            timeout=30, message="the node's banner")
        assert "using the embedded server at ./.coalescer (unix://:***@/" in banner
        sock = json.loads((tmp_path / ".coalescer" / "server.json").read_text())["socket"]
        sub = tmp_path / "sub" / "deeper"
        sub.mkdir(parents=True)

        done = cli("touch", "--rules", "../../rules.yaml", "item:1", cwd=sub)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "touched 1 key\n"
        assert done.stderr == ("coalescer touch: using the embedded server at ../../.coalescer "
                               f"(unix://:***@{sock}?db=0)\n")
        poll_until(lambda: refreshed(log, "item:1"), timeout=20,
                   message=f"the node refreshing item:1; its output:\n{out.read_text()}")
        assert not (sub / ".coalescer").exists()
        assert not (tmp_path / "sub" / ".coalescer").exists()
        assert len(valkey_servers_under(tmp_path)) == 1
    finally:
        assert stop_node(node) == 0
    assert valkey_servers_under(tmp_path) == []


def test_an_existing_coalescer_folder_above_the_rules_is_the_projects(
        tmp_path: Path, namespace: str) -> None:
    config = tmp_path / "config"
    config.mkdir()
    rules = write_rules(config, namespace, window="30s", max_wait="60s")
    (tmp_path / ".coalescer").mkdir()  # the project's server lives here already
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = cli("touch", "--rules", str(rules), "item:1", "-v", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert f"embedded server at {tmp_path / '.coalescer'}" in done.stderr
    assert (tmp_path / ".coalescer" / "data").is_dir()
    assert not (config / ".coalescer").exists() and not (elsewhere / ".coalescer").exists()

    done = cli("status", "--json", "--rules", "rules.yaml", cwd=config)
    assert done.returncode == 0, done.stderr
    assert "using the embedded server at ../.coalescer" in done.stderr
    assert json.loads(done.stdout)["rules"]["item"]["pending"] == 1
    assert valkey_servers_under(tmp_path) == []


# -- passwords are never shown --------------------------------------------------------------

PASSWORD = "s3cret-Pa55word"


@pytest.fixture
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(dir=tmp_path_factory.mktemp("locked"), password=PASSWORD)
    yield server
    server.stop()


def test_a_redis_password_is_never_shown(
        tmp_path: Path, namespace: str, locked_server: ValkeyProcess) -> None:
    rules = write_rules(tmp_path, namespace)
    url = locked_server.url
    assert PASSWORD in url
    log = tmp_path / "refreshes.log"
    node, out = start_node(tmp_path, "--rules", str(rules), "--redis", url, "--node-id", "n1",
                           "-v", env=clean_env(E2E_NODE="n1", E2E_LOG=str(log)))
    shown: list[str] = []
    try:
        banner = poll_until(lambda: "running" in out.read_text() and out.read_text(),
                            timeout=30, message="the node's banner")
        assert f"using redis://:***@127.0.0.1:{locked_server.port}/0 (from --redis)" in banner
        port = locked_server.port
        runs = [
            cli("touch", "item:1", "--rules", str(rules), "--redis", url, "-v", cwd=tmp_path),
            cli("touch", "item:2", "--rules", str(rules), "-v", cwd=tmp_path,
                env={"COALESCER_REDIS_URL": f"redis://default:{PASSWORD}@127.0.0.1:{port}/0"}),
            cli("status", "--rules", str(rules), "-v", "--redis",
                f"redis://127.0.0.1:{port}/0?password={PASSWORD}", cwd=tmp_path),
            cli("retry", "--all", "--rules", str(rules), "--redis", url, cwd=tmp_path),
        ]
        for done in runs:
            shown += [done.stdout, done.stderr]
            assert done.returncode == 0, done.stderr
        assert "using redis://:***@127.0.0.1" in runs[0].stderr
        assert "(from --redis)" in runs[0].stderr
        assert f"using redis://default:***@127.0.0.1:{port}/0 (from $COALESCER_REDIS_URL)" \
            in runs[1].stderr
        assert "?password=***" in runs[2].stderr
        poll_until(lambda: refreshed(log, "item:1") and refreshed(log, "item:2"), timeout=20,
                   message=f"both keys refreshed; the node's output:\n{out.read_text()}")
    finally:
        assert stop_node(node) == 0
        shown.append(out.read_text())
    assert "INFO" in shown[-1]  # the node logged, and
    assert not [text for text in shown if PASSWORD in text]  # nothing showed the password


def test_a_wrong_password_is_one_clear_line_without_it(
        tmp_path: Path, namespace: str, locked_server: ValkeyProcess) -> None:
    rules = write_rules(tmp_path, namespace)
    port = locked_server.port
    for command in (["touch", "item:1"], ["status"], ["run", "--http", "off"]):
        done = cli(*command, "--rules", str(rules), "--redis",
                   f"redis://:not-{PASSWORD}@127.0.0.1:{port}/0", cwd=tmp_path)
        assert done.returncode == 1
        assert done.stderr == (
            f"coalescer {command[0]}: redis://:***@127.0.0.1:{port}/0: the server refused the "
            "password (invalid username-password pair or user is disabled.)\n"), done.stderr
    done = cli("status", "--rules", str(rules), "--redis", f"redis://127.0.0.1:{port}/0",
               cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == (f"coalescer status: redis://127.0.0.1:{port}/0: the server requires "
                           "a password; give it in the URL: redis://:PASSWORD@HOST:PORT/0\n")


ITEM_RULES = """\
namespace: {ns}
rules:
  - name: customer
    match: "stats:customer:{{id}}"
    items: {{max: 10}}
    handler: {{mod}}:refresh
  - name: item
    match: "item:{{id}}"
    handler: {{mod}}:refresh
"""


def test_touch_with_items_stores_them_for_the_keys_next_refresh(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis) -> None:
    rules = line_rules(tmp_path, f"cli_{namespace}", ITEM_RULES.format(ns=namespace))
    done = cli("touch", "stats:customer:1", "stats:customer:2", "--item", "order:7",
               "--item", "order:8", "--rules", str(rules), "--redis", redis_url, "--json",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"touched": 2, "items": 2}
    sk = KeySpace(namespace, 1).shard(0)
    for key in ("stats:customer:1", "stats:customer:2"):
        assert r.zscore(sk.due("customer"), key) is not None
        assert r.smembers(sk.items(key)) == {"order:7", "order:8"}


@pytest.mark.parametrize(("args", "says"), [
    (("stats:customer:1", "--item", ""), "an item must not be empty"),
    (("stats:customer:1", "item:1", "--item", "o1"), "its rule 'item' takes no items"),
    (("stats:customer:1", "--item", "x" * 300), "over the limit of 256"),
])
def test_touch_with_an_item_that_cannot_be_touched_exits_2_and_touches_nothing(
        tmp_path: Path, namespace: str, redis_url: str, r: redis.Redis,
        *, args: tuple[str, ...], says: str) -> None:
    rules = line_rules(tmp_path, f"cli_{namespace}", ITEM_RULES.format(ns=namespace))
    done = cli("touch", *args, "--rules", str(rules), "--redis", redis_url, cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr and "nothing was touched" in done.stderr
    assert r.keys(f"{namespace}:*") == []


def test_help_never_breaks_a_path_at_its_hyphens() -> None:
    parser = build_parser()
    path = "/srv/the-shop-of-anna/stats-service/config/coalescer-rules.yaml"
    parser.add_argument("--example", help=f"rules file (default {path}, from a setting)")
    assert path in parser.format_help()  # whole, to be copied: argparse split it at '-'
