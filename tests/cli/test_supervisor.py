"""`coalescer run --processes N`: a supervisor of N real node processes on a real server.

The supervisor is started as a user would start it (a subprocess); its children are
found through what `coalescer status` shows (node ids HOST:PID, or ID-k) and /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.e2e import clean_env
from tests.helpers.servers import free_port, poll_until

RULES = """\
namespace: {ns}
shards: {shards}
rules:
  - name: item
    match: "item:{{id}}"
    window: 100ms
    handler: handlers:refresh
    isolation: thread
"""  # every other setting at its default: concurrency 16, leases 3 s / 5 s, retries 5
# (on threads: the handler's pid is the node process's)

HANDLERS = """\
import os


def refresh(claim):
    with open(os.environ["SUP_LOG"], "a") as f:
        f.write(f"{os.getpid()} {claim.key}\\n")
"""


class Group:
    """One `coalescer run --processes N` subprocess; killed with its children at teardown."""

    def __init__(self, folder: Path, rules: Path, redis_url: str, *extra: str) -> None:
        self.folder = folder
        self.rules = rules
        self.redis_url = redis_url
        self.log = folder / "refreshes.log"
        self.out = folder / "supervisor.out"
        cmd = [sys.executable, "-m", "coalescer.cli", "run", "--rules", str(rules),
               "--redis", redis_url, *extra]
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=folder, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT,
                                         env=clean_env(SUP_LOG=str(self.log)))
        self.seen_children: set[int] = set()

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def children(self) -> set[int]:
        """The live child pids, read from /proc (zombies not yet reaped left out)."""
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                state, ppid = stat.rsplit(")", 1)[1].split()[:2]
                if int(ppid) == self.proc.pid and state != "Z":
                    found.add(int(entry.name))
        self.seen_children |= found
        return found

    def status(self) -> dict[str, object]:
        done = subprocess.run([sys.executable, "-m", "coalescer.cli", "status", "--json",
                               "--rules", str(self.rules), "--redis", self.redis_url],
                              capture_output=True, text=True, timeout=30, env=clean_env(),
                              check=True)
        parsed: dict[str, object] = json.loads(done.stdout)
        return parsed

    def leaders(self) -> set[str]:
        shards = self.status()["shards"]
        assert isinstance(shards, list)
        return {s["leader"] for s in shards if s["leader"]}

    def touch(self, *keys: str) -> None:
        subprocess.run([sys.executable, "-m", "coalescer.cli", "touch", *keys, "--rules",
                        str(self.rules), "--redis", self.redis_url], check=True, timeout=30,
                       env=clean_env(), capture_output=True)

    def refreshed_by(self) -> dict[str, set[int]]:
        """key -> pids of the processes that refreshed it."""
        out: dict[str, set[int]] = {}
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                pid, key = line.split()
                out.setdefault(key, set()).add(int(pid))
        return out

    def kill_all(self) -> None:
        for pid in self.children() | self.seen_children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def group(tmp_path: Path, rules_file, redis_url: str, namespace: str) -> Iterator:  # type: ignore[no-untyped-def]
    started: list[Group] = []

    def start(*extra: str, shards: int = 4) -> Group:
        rules = rules_file(RULES.format(ns=namespace, shards=shards), HANDLERS)
        g = Group(tmp_path, rules, redis_url, *extra)
        started.append(g)
        return g

    yield start
    for g in started:
        g.kill_all()


def node_pid(node_id: str) -> int:
    host, _, pid = node_id.rpartition(":")
    assert host == socket.gethostname(), node_id
    return int(pid)


def test_two_processes_lead_the_shards_between_them_and_refresh(group) -> None:  # type: ignore[no-untyped-def]
    g = group("--processes", "2", "--http", "off")
    poll_until(lambda: len(g.children()) == 2, timeout=20)
    poll_until(lambda: len(g.leaders()) == 2, timeout=30)
    leaders = g.leaders()
    assert {node_pid(n) for n in leaders} == g.children()
    assert all(node_pid(n) != g.proc.pid for n in leaders)
    keys = [f"item:{i}" for i in range(40)]
    g.touch(*keys)
    poll_until(lambda: set(g.refreshed_by()) == set(keys), timeout=20)
    refreshers = set().union(*g.refreshed_by().values())
    assert refreshers == g.children()  # both processes did work: the shards are spread


def test_a_killed_child_is_restarted_and_keys_still_refresh(group) -> None:  # type: ignore[no-untyped-def]
    g = group("--processes", "2", "--http", "off")
    poll_until(lambda: len(g.leaders()) == 2, timeout=30)
    first = g.children()
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    poll_until(lambda: len(g.children()) == 2 and g.children() - first, timeout=20,
               message="a new child in place of the killed one")
    newcomer = (g.children() - first).pop()
    assert f"(pid {victim}) was killed by SIGKILL; restarting it" in g.output()
    # the new child takes its share of the shards once the dead one's leases run out
    poll_until(lambda: newcomer in {node_pid(n) for n in g.leaders()}, timeout=30)
    g.touch("item:after-the-kill", "item:x", "item:y", "item:z")
    poll_until(lambda: {"item:after-the-kill", "item:x", "item:y", "item:z"}
               <= set(g.refreshed_by()), timeout=20)
    assert victim not in set().union(*g.refreshed_by().values())


def test_sigterm_drains_every_child_and_leaves_none_behind(group) -> None:  # type: ignore[no-untyped-def]
    g = group("--processes", "3", "--http", "off", shards=1)
    poll_until(lambda: len(g.children()) == 3, timeout=20)
    poll_until(lambda: len(g.leaders()) == 1, timeout=30)
    children = g.children()
    g.touch("item:1")
    poll_until(lambda: "item:1" in g.refreshed_by(), timeout=20)
    g.proc.send_signal(signal.SIGTERM)
    assert g.proc.wait(timeout=60) == 0, g.output()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the supervisor"
    out = g.output()
    assert out.count(" exited 0") == 3, out


def test_a_stop_while_the_children_start_is_a_clean_stop(group) -> None:  # type: ignore[no-untyped-def]
    g = group("--processes", "2", "--http", "off", shards=1)
    poll_until(lambda: g.output().count(" started, pid ") == 2, timeout=20,
               message="both children spawned")
    g.proc.send_signal(signal.SIGTERM)  # they are still importing: no handler set yet
    assert g.proc.wait(timeout=60) == 0, g.output()
    assert g.output().count(" exited 0") + g.output().count(" while it was starting") == 2


def free_port_pair() -> int:
    """A port ``p`` on 127.0.0.1 such that ``p`` and ``p + 1`` were both free a moment ago,
    below the kernel's ephemeral range, so no outgoing connection takes ``p + 1`` meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, low - 1), 500):
        with contextlib.ExitStack() as held:
            try:
                for p in (port, port + 1):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", p))
            except OSError:
                continue
            return port
    raise AssertionError("no two free ports in a row below the ephemeral range")


def test_node_ids_and_http_ports_are_numbered_per_child(group) -> None:  # type: ignore[no-untyped-def]
    port = free_port_pair()  # child k serves on port + k
    g = group("--processes", "2", "--node-id", "web", "--http", f"127.0.0.1:{port}")
    try:
        poll_until(lambda: g.leaders() == {"web-0", "web-1"}, timeout=60,
                   message="both children to lead shards")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the group said:\n{g.output()[-4000:]}") from None
    for p in (port, port + 1):
        def healthy(p: int = p) -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p}/healthz", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False
        poll_until(healthy, timeout=20)


def test_children_that_keep_crashing_stop_the_group_non_zero(tmp_path: Path, rules_file,  # type: ignore[no-untyped-def]
                                                             namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=4), HANDLERS)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: every child exits 1
    g = Group(tmp_path, rules, nowhere, "--processes", "2", "--http", "off")
    try:
        assert g.proc.wait(timeout=60) == 1
    finally:
        g.kill_all()
    out = g.output()
    assert "keeps crashing (5 times in a row" in out, out
    assert "restarting it in 0.5s" in out and "restarting it in 4s" in out, out
    assert not g.children()


def test_a_bad_rules_file_starts_no_child(tmp_path: Path, redis_url: str) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("namespace: x\nrules:\n  - name: a\n    match: 'a:{id}'\n    window: soon\n"
                     "    handler: nowhere:fn\n")
    done = subprocess.run([sys.executable, "-m", "coalescer.cli", "run", "--processes", "2",
                           "--rules", str(rules), "--redis", redis_url, "--http", "off"],
                          capture_output=True, text=True, timeout=30, env=clean_env(), check=False)
    assert done.returncode == 1
    assert "rules.yaml" in done.stderr and "window" in done.stderr
    assert "child" not in done.stderr


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_processes_must_be_a_whole_number_of_one_or_more(value: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "coalescer.cli", "run", "--processes", value],
                          capture_output=True, text=True, timeout=30, env=clean_env(),
                          cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert "--processes" in done.stderr and "whole number of 1 or more" in done.stderr


def test_http_ports_past_the_last_port_are_refused(tmp_path: Path, rules_file, redis_url: str,  # type: ignore[no-untyped-def]
                                                  namespace: str) -> None:
    rules = rules_file(RULES.format(ns=namespace, shards=1), HANDLERS)
    done = subprocess.run([sys.executable, "-m", "coalescer.cli", "run", "--processes", "3",
                           "--rules", str(rules), "--redis", redis_url,
                           "--http", "127.0.0.1:65534"],
                          capture_output=True, text=True, timeout=30, env=clean_env(), check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "coalescer run: --http: --http port 65534 + 2 children is past 65535"], done.stderr

