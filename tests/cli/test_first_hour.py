"""What a new user meets in their first hour with the command line: stopping a node with
Ctrl-C, seeing each refresh, `check` catching what `run` would refuse, `check -v`, and
output piped into a reader that leaves early."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coalescer.cli.main import main
from coalescer.cli.parser import build_parser
from tests.helpers.e2e import clean_env, coalescer_cmd
from tests.helpers.servers import poll_until

# The handler writes "start KEY" then waits until the file "release" exists beside it.
HANDLER = """\
import asyncio
import pathlib

HERE = pathlib.Path(__file__).parent


def _note(line):
    with open(HERE / "calls.log", "a") as f:
        f.write(line + "\\n")


async def refresh(claim):
    _note("start " + claim.key)
    while not (HERE / "release").exists():
        await asyncio.sleep(0.01)
    _note("done " + claim.key)
"""

RULES = """\
namespace: {ns}
leader_lease: 1s
claim_lease: 1s
rules:
  - name: slow
    match: "slow:{{id}}"
    window: 20ms
    absorb: 5ms
    handler: held_{ns}:refresh
"""


class Node:
    """A `coalescer run` child of one test, its output in a file; killed at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, redis_url: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.out").open("ab") as out:
            proc = subprocess.Popen(
                [*coalescer_cmd(), "run", "--rules", str(self.folder / "rules.yaml"),
                 "--redis", redis_url, "--http", "off", "--node-id", name, *args],
                cwd=self.folder, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=clean_env())
        self.procs.append(proc)
        return proc

    def output(self, name: str) -> str:
        path = self.folder / f"{name}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def calls(self) -> list[str]:
        path = self.folder / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def touch(self, redis_url: str, *keys: str) -> None:
        done = subprocess.run([*coalescer_cmd(), "touch", "--rules",
                               str(self.folder / "rules.yaml"), "--redis", redis_url, *keys],
                              capture_output=True, text=True, env=clean_env(), timeout=60,
                              check=False)
        assert done.returncode == 0, done.stderr


@pytest.fixture
def node(tmp_path: Path, namespace: str) -> Iterator[Node]:
    (tmp_path / f"held_{namespace}.py").write_text(HANDLER)
    (tmp_path / "rules.yaml").write_text(RULES.format(ns=namespace))
    n = Node(tmp_path)
    yield n
    for proc in n.procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _running(node: Node, redis_url: str, name: str, *args: str) -> subprocess.Popen[bytes]:
    proc = node.start(redis_url, name, *args)
    poll_until(lambda: " running, using " in node.output(name), timeout=30,
               message=f"{name} running")
    return proc


# -- Ctrl-C: the first says what it waits for, a second stops at once ----------------------


def test_the_first_ctrl_c_says_what_it_waits_for_and_the_refresh_ends_and_is_shown(
        node: Node, redis_url: str) -> None:
    proc = _running(node, redis_url, "n1", "--grace", "2m")
    node.touch(redis_url, "slow:1")
    poll_until(lambda: "start slow:1" in node.calls(), message="the refresh started")
    proc.send_signal(signal.SIGINT)
    poll_until(lambda: "stopping: waiting" in node.output("n1"), message="the stopping line")
    assert ("stopping: waiting up to 2m for 1 running refresh (key slow:1); press Ctrl-C "
            "again to stop at once") in node.output("n1")
    assert proc.poll() is None  # it waits for the refresh
    (node.folder / "release").touch()
    assert proc.wait(timeout=30) == 0
    assert node.calls() == ["start slow:1", "done slow:1"]
    # without -v, each refresh has its INFO line
    assert [line.split(": ", 1)[1].split(" in ")[0] for line in node.output("n1").splitlines()
            if " INFO coalescer.worker.runner: refreshed " in line] == ["refreshed slow:1"]


def test_a_second_ctrl_c_cancels_the_refresh_and_its_key_runs_again_after_its_lease(
        node: Node, redis_url: str) -> None:
    proc = _running(node, redis_url, "n1", "--grace", "2m")
    node.touch(redis_url, "slow:1")
    poll_until(lambda: "start slow:1" in node.calls(), message="the refresh started")
    proc.send_signal(signal.SIGINT)
    poll_until(lambda: "stopping: waiting" in node.output("n1"), message="the stopping line")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert ("stopping at once: cancelling 1 running refresh (key slow:1); they run again "
            "once their claim lease expires") in node.output("n1")
    assert node.calls() == ["start slow:1"]  # cancelled: it never finished
    # as after a crash, another node runs the key once its claim lease has expired;
    # with -q it shows no line per refresh
    (node.folder / "release").touch()
    quiet = _running(node, redis_url, "n2", "-q")
    poll_until(lambda: "done slow:1" in node.calls(), timeout=30, message="slow:1 re-run")
    quiet.send_signal(signal.SIGTERM)
    assert quiet.wait(timeout=30) == 0
    assert node.calls() == ["start slow:1", "start slow:1", "done slow:1"]
    assert "refreshed slow:1" not in node.output("n2")
    assert "stopping: no refresh is running" in node.output("n2")


def test_a_repeated_sigterm_still_drains(node: Node, redis_url: str) -> None:
    proc = _running(node, redis_url, "n1", "--grace", "2m")
    node.touch(redis_url, "slow:1")
    poll_until(lambda: "start slow:1" in node.calls(), message="the refresh started")
    proc.send_signal(signal.SIGTERM)
    poll_until(lambda: "stopping: waiting" in node.output("n1"), message="the stopping line")
    assert ("stopping: waiting up to 2m for 1 running refresh (key slow:1); send SIGINT to "
            "stop at once") in node.output("n1")
    proc.send_signal(signal.SIGTERM)  # as systemd may: to the unit's every process
    poll_until(lambda: "SIGTERM again" in node.output("n1"), message="the second SIGTERM")
    assert ("stopping: SIGTERM again; still waiting for 1 running refresh (key slow:1); "
            "send SIGINT to stop at once") in node.output("n1")
    (node.folder / "release").touch()
    assert proc.wait(timeout=30) == 0
    assert node.calls() == ["start slow:1", "done slow:1"]


SYNC_HANDLER = """\
import pathlib
import threading

HERE = pathlib.Path(__file__).parent


def _note(line):
    with open(HERE / "calls.log", "a") as f:
        f.write(line + "\\n")


def refresh(claim):
    _note("start " + claim.key)
    while not (HERE / "release").exists():
        threading.Event().wait(0.01)
    _note("done " + claim.key)
"""


def test_a_ctrl_c_in_the_terminal_lets_a_handler_in_a_child_process_finish(
        node: Node, redis_url: str, namespace: str) -> None:
    (node.folder / f"held_{namespace}.py").write_text(SYNC_HANDLER)
    rules = node.folder / "rules.yaml"
    rules.write_text(rules.read_text().replace("    absorb: 5ms\n",
                                               "    absorb: 5ms\n    isolation: process\n"))
    with (node.folder / "iso.out").open("ab") as out:
        proc = subprocess.Popen(  # a session of its own: its process group gets the Ctrl-C
            [*coalescer_cmd(), "run", "--rules", str(rules), "--redis", redis_url, "--http",
             "off", "--grace", "2m"], cwd=node.folder, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    node.procs.append(proc)
    poll_until(lambda: " running, using " in node.output("iso"), timeout=30,
               message="the node running")
    node.touch(redis_url, "slow:1")
    poll_until(lambda: "start slow:1" in node.calls(), timeout=30, message="the refresh started")
    os.killpg(proc.pid, signal.SIGINT)  # the node and its handler's child process get it
    poll_until(lambda: "stopping: waiting" in node.output("iso"), message="the stopping line")
    (node.folder / "release").touch()
    assert proc.wait(timeout=30) == 0
    assert node.calls() == ["start slow:1", "done slow:1"]
    assert "refreshed slow:1 in" in node.output("iso")


def test_ctrl_c_in_a_terminal_reaches_supervised_nodes_once_and_twice_stops_them_at_once(
        node: Node, redis_url: str) -> None:
    with (node.folder / "group.out").open("ab") as out:
        group = subprocess.Popen(  # a session of its own: its process group gets the Ctrl-C
            [*coalescer_cmd(), "run", "--rules", str(node.folder / "rules.yaml"), "--redis",
             redis_url, "--http", "off", "--grace", "2m", "--processes", "2"],
            cwd=node.folder, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=clean_env(), start_new_session=True)
    node.procs.append(group)
    poll_until(lambda: node.output("group").count(" running, using ") == 2, timeout=30,
               message="both nodes running")
    node.touch(redis_url, "slow:1")
    poll_until(lambda: "start slow:1" in node.calls(), message="the refresh started")
    os.killpg(group.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    poll_until(lambda: " exited 0" in node.output("group"), timeout=30,
               message="the idle node stopped")
    shown = node.output("group")
    assert shown.count("stopping: waiting up to 2m for 1 running refresh (key slow:1)") == 1
    assert shown.count("stopping: no refresh is running") == 1
    assert "stopping at once" not in shown and group.poll() is None  # one Ctrl-C: it drains
    os.killpg(group.pid, signal.SIGINT)
    assert group.wait(timeout=30) == 130
    assert "stopping at once: cancelling 1 running refresh (key slow:1)" in node.output("group")
    assert node.calls() == ["start slow:1"]


# -- check: what run would refuse, the sources, -v ---------------------------------------

SOURCES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    handler: h_{ns}:refresh
sources:
  - name: orders-stream
    type: stream
    stream: orders
    key: "stats:{{customer}}"
  - name: orders-outbox
    type: outbox
    url: "{url}"
  - name: events
    type: kafka
    bootstrap: "{bootstrap}"
    topics: [events, more]
    key: "stats:{{customer}}"
"""


def _sources_file(tmp_path: Path, namespace: str, *, url: str = "sqlite:///app.db",
                  bootstrap: str = "127.0.0.1:9092") -> Path:
    (tmp_path / f"h_{namespace}.py").write_text(
        "async def refresh(claim):\n    pass\n\n\ndef plain(claim):\n    pass\n")
    path = tmp_path / "rules.yaml"
    path.write_text(SOURCES.format(ns=namespace, url=url, bootstrap=bootstrap))
    return path


@pytest.mark.parametrize("case", [
    ("psycopg", "postgresql://app:s3cret@127.0.0.1/app", "11: sources[1].url",
     "reading postgresql needs the psycopg package, which is not installed"),
    ("aiosqlite", "sqlite:///app.db", "11: sources[1].url",
     "reading sqlite needs the aiosqlite package, which is not installed"),
    ("aiokafka", "sqlite:///app.db", "14: sources[2].type",
     "reading Kafka needs aiokafka: pip install 'coalescer[kafka]'"),
])
def test_check_refuses_a_source_whose_driver_is_not_installed_as_run_does(
        tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], case: tuple[str, str, str, str]) -> None:
    missing, url, where, message = case
    monkeypatch.setitem(sys.modules, missing, None)  # its import fails, as when not installed
    path = _sources_file(tmp_path, namespace, url=url)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    [line, count] = err.splitlines()
    assert line.startswith(f"{path}:{where}: source ") and message in line
    assert count == f"1 error in {path}"
    assert "s3cret" not in err
    assert main(["run", "--rules", str(path), "--redis", "redis://127.0.0.1:1/0",
                 "--http", "off", "-q"]) == 1
    assert message in capsys.readouterr().err  # the same refusal


def test_check_refuses_a_kafka_source_without_aiokafka_whose_bootstrap_is_not_set_here(
        tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "aiokafka", None)
    monkeypatch.delenv("H6_UNSET_BOOTSTRAP", raising=False)
    path = _sources_file(tmp_path, namespace, bootstrap="${H6_UNSET_BOOTSTRAP}")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in err[:-1]] == [
        "sources[2].type", "sources[2].bootstrap"]  # the error, then the variable's warning
    assert err[0].endswith("source 'events': reading Kafka needs aiokafka: pip install "
                           "'coalescer[kafka]'")
    assert err[-1] == f"1 error, 1 warning in {path}"


def test_check_lists_the_sources_and_what_they_read(
        tmp_path: Path, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = _sources_file(tmp_path, namespace, url="postgresql://app:s3cret@127.0.0.1/app")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.split("3 source(s):\n")[1].splitlines() == [
        f"   stream orders-stream  (line 7): reads stream 'orders' (group "
        f"coalescer.{namespace}.orders-stream, start new), touches stats:{{customer}}",
        "   outbox orders-outbox  (line 11): reads table coalescer_outbox of "
        "postgresql://app:***@127.0.0.1/app (batch 1000, polled every 1s at most), touches "
        "each row's key",
        "   kafka events  (line 14): reads topic(s) events, more from 127.0.0.1:9092 (group "
        f"coalescer.{namespace}.events, start latest), touches stats:{{customer}}"]
    assert main(["check", "--json", str(path)]) == 0
    sources = json.loads(capsys.readouterr().out)["sources"]
    assert [(s["type"], s["name"], s["line"]) for s in sources] == [
        ("stream", "orders-stream", 7), ("outbox", "orders-outbox", 11),
        ("kafka", "events", 14)]
    assert [s.get("group") for s in sources] == [
        f"coalescer.{namespace}.orders-stream", None, f"coalescer.{namespace}.events"]
    assert "s3cret" not in json.dumps(sources)


def test_check_v_says_how_each_handler_runs_and_where_it_is_defined(
        tmp_path: Path, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = tmp_path / f"h_{namespace}.py"
    module.write_text("async def refresh(claim):\n    pass\n\n\ndef plain(claim):\n    pass\n")
    path = tmp_path / "rules.yaml"
    path.write_text(f"namespace: {namespace}\nrules:\n"
                    f"  - {{name: a, match: 'a:*', handler: h_{namespace}:refresh}}\n"
                    f"  - {{name: b, match: 'b:*', handler: h_{namespace}:plain}}\n"
                    "  - {name: c, match: 'c:*', handler: {http: {url: 'http://127.0.0.1:9/c'}}}\n"
                    f"  - {{name: d, match: 'd:*', handler: h_{namespace}:plain, "
                    "isolation: thread}\n")
    assert main(["check", "-v", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.split("handlers:\n")[1].splitlines() == [
        f"   a: async def: runs on the node's event loop, defined in {module}:1",
        f"   b: def: runs in a child process (isolation: process), defined in {module}:5",
        "   c: webhook POST http://127.0.0.1:9/c",
        f"   d: def: runs on a worker thread (isolation: thread), defined in {module}:5"]
    assert main(["check", str(path)]) == 0
    assert "handlers:" not in capsys.readouterr().out  # only with -v
    assert main(["check", "-v", "--no-import", str(path)]) == 0
    assert (f"   a: h_{namespace}:refresh (not imported: --no-import)"
            in capsys.readouterr().out)


def test_check_takes_no_redis_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--redis", "redis://127.0.0.1:6379/0"])
    assert "unrecognized arguments: --redis" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["check", "--help"])
    assert exited.value.code == 0
    check_help = capsys.readouterr().out
    assert "--redis" not in check_help
    assert "-v, --verbose" in check_help


# -- a reader that leaves early --------------------------------------------------------------


@pytest.mark.parametrize("command", [["history"], ["status"], ["check"]])
def test_output_into_a_closed_pipe_ends_quietly(
        tmp_path: Path, redis_url: str, namespace: str, command: list[str]) -> None:
    (tmp_path / f"held_{namespace}.py").write_text(HANDLER)
    (tmp_path / "rules.yaml").write_text(RULES.format(ns=namespace))
    options = [] if command == ["check"] else ["--redis", redis_url]
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line
    try:
        done = subprocess.run([*coalescer_cmd(), *command, "--rules",
                               str(tmp_path / "rules.yaml"), *options], stdout=write,
                              stderr=subprocess.PIPE, text=True, env=clean_env(), timeout=60,
                              check=False)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 141
