"""The Django example project, run as its README says: migrate, check the rules, a node
through manage.py, orders placed through the view; the ORM handler's row in SQLite."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.e2e import REPO, clean_env
from tests.helpers.servers import poll_until

PROJECT = REPO / "examples" / "django_project"

PLACE_ORDERS = """
from django.test import Client
for total in (1250, 50):
    print(Client().post("/orders/", {"customer": 7, "total_cents": total}).status_code)
"""


@pytest.fixture
def env(tmp_path: Path, redis_url: str, namespace: str) -> dict[str, str]:
    env = clean_env(SHOP_DB=str(tmp_path / "shop.sqlite3"), COALESCER_REDIS_URL=redis_url,
                    COALESCER_NAMESPACE=namespace)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60, check=False)


class Node:
    """``manage.py coalescer run --http off ARGS`` of the example, killed at teardown."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "manage.py", "coalescer", "run", "--http", "off", *args],
                cwd=PROJECT, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT)
        return self.proc

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)


@pytest.fixture
def node(env: dict[str, str], tmp_path: Path) -> Iterator[Node]:
    started = Node(env, tmp_path / "node.log")
    yield started
    if started.proc is not None and started.proc.poll() is None:
        started.proc.kill()
    if started.proc is not None:
        started.proc.wait()


def stats(db: Path, customer: int) -> tuple[int, int] | None:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT orders, total_cents FROM shop_customerstats "
                           "WHERE customer_id = ?", (customer,)).fetchone()
    return (row[0], row[1]) if row else None


def refreshed(node: Node, db: Path, nodes: int = 1) -> None:
    """Place two orders through the view; wait for the handler's row, then stop the
    ``nodes`` node processes once every one is running."""
    placed = manage(node.env, "shell", "-c", PLACE_ORDERS)
    assert placed.stdout.split()[-2:] == ["201", "201"], placed.stderr
    proc = node.proc
    assert proc is not None
    poll_until(lambda: stats(db, 7) == (2, 1300) or proc.poll() is not None, timeout=20,
               message="the customer's stats row")
    assert stats(db, 7) == (2, 1300), node.log.read_text()
    poll_until(lambda: node.log.read_text().count(" running, using ") == nodes, timeout=20,
               message=f"{nodes} running node processes")
    assert node.stop() == 0, node.log.read_text()


def test_a_node_run_through_manage_py_refreshes_what_the_view_touched(
        env: dict[str, str], tmp_path: Path, node: Node) -> None:
    migrated = manage(env, "migrate", "-v0")
    assert migrated.returncode == 0, migrated.stderr
    checked = manage(env, "coalescer", "check")
    assert checked.returncode == 0, checked.stderr
    assert "shop.handlers:refresh_customer_stats" in checked.stdout
    node.start()
    refreshed(node, tmp_path / "shop.sqlite3")


def test_a_handler_in_a_child_process_imports_its_models_too(
        env: dict[str, str], tmp_path: Path, node: Node) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text((PROJECT / "rules.yaml").read_text() + "    isolation: process\n")
    assert manage(env, "migrate", "-v0").returncode == 0
    node.start("--rules", str(rules))
    refreshed(node, tmp_path / "shop.sqlite3")


def test_the_examples_own_pytest_django_tests_pass(redis_url: str) -> None:
    """``pytest`` in the example's folder, as its developer runs it (pytest-django and
    the coalescer plugin), on the suite's Valkey."""
    env = clean_env(COALESCER_TEST_REDIS_URL=redis_url, PYTHONDONTWRITEBYTECODE="1")
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=PROJECT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.slow  # a supervisor and two node processes, each setting Django up
def test_run_processes_starts_children_that_set_django_up_too(
        env: dict[str, str], tmp_path: Path, node: Node) -> None:
    assert manage(env, "migrate", "-v0").returncode == 0
    node.start("--processes", "2")
    refreshed(node, tmp_path / "shop.sqlite3", nodes=2)
