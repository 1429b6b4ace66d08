"""The examples under examples/, each run as a user would: real processes, real servers."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.postgres import PostgresServer
from coalescer import Coalescer, Config
from examples.stats_app import customer_stats as stats_db
from tests.helpers.e2e import REPO, clean_env
from tests.helpers.servers import ValkeyProcess, free_port, poll_until

PY = sys.executable


class Procs:
    """Child processes of one test, logs in its tmp folder; all stopped at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *cmd: str, **env: str) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(list(cmd), cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=clean_env(**env))
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str, timeout: float = 20) -> int:
        """SIGTERM, then the exit status (SIGKILL if it would not exit)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} did not exit on SIGTERM:\n{self.log(name)}") from None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    started = Procs(tmp_path)
    yield started
    started.stop_all()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(procs: Procs, name: str, port: int) -> None:
    def up() -> bool:
        if procs.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited:\n{procs.log(name)}")
        return listening(port)
    poll_until(up, timeout=15, message=f"{name} listening on {port}")


def http(method: str, url: str, body: Any = None,
         raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def node_cmd(rules: Path, redis_url: str) -> list[str]:
    return [PY, "-m", "coalescer.cli", "run", "--rules", str(rules), "--redis", redis_url,
            "--http", "off"]


# -- stats_app ----------------------------------------------------------------------------

STATS_RULES = REPO / "examples" / "stats_app" / "rules.yaml"


def test_stats_app_bulk_import_refreshes_each_customer_once_and_stats_equal_a_recompute(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs) -> None:
    """The README's three commands, with the import's defaults: 10,000 orders."""
    db = tmp_path / "stats.db"
    port = free_port()
    app_url = f"http://127.0.0.1:{port}"
    procs.start("node", *node_cmd(STATS_RULES, own_server.url), STATS_DB=str(db))
    procs.start("app", PY, "-m", "examples.stats_app.app", "--redis", own_server.url,
                STATS_DB=str(db), PORT=str(port))  # the app and the import: $PORT
    wait_listening(procs, "app", port)
    assert f"the stats app listening on {app_url} (port {port}: $PORT)" in procs.log("app")

    done = subprocess.run([PY, "-m", "examples.stats_app.bulk_import",
                           "--redis", own_server.url], cwd=REPO,
                          env=clean_env(STATS_DB=str(db), PORT=str(port)),
                          capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 0, done.stdout + done.stderr + procs.log("node")
    ran = int(re.findall(r"refreshes run: (\d+) \(a refresh per write would have run 10,000\)",
                         done.stdout)[0])
    assert "stats equal a full recompute for 100 of 100 customers" in done.stdout
    conn = stats_db.connect(db)
    try:
        # checked here too, not only by the script's word
        assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 10_000
        assert len(stats_db.recomputed(conn)) == 100
        assert stats_db.mismatches(conn) == {}
        assert stats_db.refreshes_since(conn, 0) == ran
    finally:
        conn.close()
    # one refresh per customer: the burst is over long before max_wait (30 s)
    assert 100 <= ran < 200, done.stdout
    assert procs.stop("app") == 0
    assert procs.stop("node") == 0


def test_stats_app_with_the_outbox_loses_nothing_and_stats_equal_a_recompute(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs) -> None:
    """The outbox set-up: the app writes touches in the orders' transactions, the node
    reads them (rules_outbox.yaml, its url pointed at this test's database)."""
    db = tmp_path / "stats.db"
    text = STATS_RULES.with_name("rules_outbox.yaml").read_text()
    text = text.replace('"sqlite:///stats.db"', f'"sqlite:///{db}"').replace(
        "customer_stats:refresh", "examples.stats_app.customer_stats:refresh")
    rules = tmp_path / "rules_outbox.yaml"
    rules.write_text(text)
    stats_db.init_db(db)  # the node reads a database it never creates
    port = free_port()
    procs.start("node", *node_cmd(rules, own_server.url), STATS_DB=str(db))
    procs.start("app", PY, "-m", "examples.stats_app.app", "--outbox", STATS_DB=str(db),
                PORT=str(port))  # no --redis: the app never talks to Redis
    wait_listening(procs, "app", port)
    done = subprocess.run([PY, "-m", "examples.stats_app.bulk_import", "--rules", str(rules),
                           "--redis", own_server.url, "--orders", "2000"], cwd=REPO,
                          env=clean_env(STATS_DB=str(db), PORT=str(port)),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr + procs.log("node")
    written = int(re.findall(r"outbox: ([\d,]+) touches committed with the orders",
                             done.stdout)[0].replace(",", ""))
    assert 100 <= written <= 2000  # a row per customer per request (20 requests)
    assert "0 left waiting: every one reached Redis" in done.stdout
    assert "stats equal a full recompute for 100 of 100 customers" in done.stdout
    conn = stats_db.connect(db)
    try:
        assert stats_db.mismatches(conn) == {}
        assert stats_db.outbox_rows(conn) == (0, written)
    finally:
        conn.close()
    assert procs.stop("app") == 0
    assert procs.stop("node") == 0


def new_pg_database(postgres: PostgresServer) -> str:
    """A new, empty database of the suite's PostgreSQL server: its URL. The example's
    tables have fixed names (coalescer_outbox too), so each test gets a database."""
    import psycopg

    name = f"stats_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.url.rsplit("/", 1)[0] + f"/{name}"


def test_stats_app_with_the_outbox_in_postgresql_loses_nothing_and_stats_equal_a_recompute(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs,
        postgres: PostgresServer) -> None:
    """The README's PostgreSQL commands: $STATS_DB a postgresql:// URL for the app, the
    import and the node (rules_outbox_pg.yaml reads the outbox at that URL)."""
    url = new_pg_database(postgres)
    rules = tmp_path / "rules_outbox_pg.yaml"
    rules.write_text(STATS_RULES.with_name("rules_outbox_pg.yaml").read_text().replace(
        "customer_stats:refresh", "examples.stats_app.customer_stats:refresh"))
    stats_db.init_db(url)  # the node reads a database it never creates
    port = free_port()
    procs.start("node", *node_cmd(rules, own_server.url), STATS_DB=url)
    procs.start("app", PY, "-m", "examples.stats_app.app", "--outbox", STATS_DB=url,
                PORT=str(port))
    wait_listening(procs, "app", port)
    done = subprocess.run([PY, "-m", "examples.stats_app.bulk_import", "--rules", str(rules),
                           "--redis", own_server.url, "--orders", "2000"], cwd=REPO,
                          env=clean_env(STATS_DB=url, PORT=str(port)),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr + procs.log("node")
    written = int(re.findall(r"outbox: ([\d,]+) touches committed with the orders",
                             done.stdout)[0].replace(",", ""))
    assert 100 <= written <= 2000  # a row per customer per request (20 requests)
    assert "0 left waiting: every one reached Redis" in done.stdout
    assert "stats equal a full recompute for 100 of 100 customers" in done.stdout
    conn = stats_db.connect(url)
    try:
        assert conn.postgres
        assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2000
        assert len(stats_db.recomputed(conn)) == 100
        assert stats_db.mismatches(conn) == {}
        assert stats_db.outbox_rows(conn) == (0, written)
        triggers = conn.execute("SELECT COUNT(*) FROM pg_trigger WHERE tgrelid = "
                                "'coalescer_outbox'::regclass AND NOT tgisinternal")
        assert triggers.fetchone()[0] == 1  # the NOTIFY trigger: the node wakes at once
    finally:
        conn.close()
    assert procs.stop("app") == 0
    assert procs.stop("node") == 0


async def test_stats_app_batch_handler_and_fenced_writes_on_postgresql(
        postgres: PostgresServer, namespace: str, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers and the fence on PostgreSQL: the batch handler's rows equal a full
    recompute; a write with an older or equal token changes nothing."""
    url = new_pg_database(postgres)
    monkeypatch.setenv(stats_db.DB_ENV, url)
    stats_db.init_db(url)
    # again, spelt as SQLAlchemy (and the outbox source) spell it: idempotent
    stats_db.init_db(url.replace("postgresql://", "postgresql+psycopg://", 1))
    assert not stats_db.is_postgres("postgresql.db") and not stats_db.is_postgres("x/y.db")
    conn = stats_db.connect(url)
    try:
        stats_db.add_orders(conn, [(cid % 300, 100 + cid) for cid in range(1_000)])
        config = replace(Config.from_yaml(STATS_RULES.with_name("rules_batch.yaml")),
                         namespace=namespace)
        async with Coalescer(config, redis_url=redis_url, worker=False) as c:
            c.touch_many(stats_db.KEY_FORMAT.format(cid) for cid in range(301))  # 300: none
            claims = await c.drain(timeout=60)
        assert len(claims) == 301
        assert stats_db.mismatches(conn) == {}
        assert stats_db.stored(conn)[300] == stats_db.Stats(0, 0, 0.0, None)
        assert stats_db.refreshes_since(conn, 0) == 301

        newer = max(claim.token for claim in claims) + 10  # above every token the drain had
        stale = stats_db.compute(conn, 7)        # a holder reads, then pauses
        stats_db.add_orders(conn, [(7, 5000)])
        assert stats_db.refresh(conn, 7, token=newer)  # a newer claim refreshes
        fresh = stats_db.stored(conn)[7]
        assert fresh.orders == stale.orders + 1
        assert not stats_db.write_stats(conn, 7, stale, token=newer - 1)
        assert not stats_db.write_stats(conn, 7, stale, token=newer)
        assert stats_db.stored(conn)[7] == fresh
        assert stats_db.mismatches(conn) == {}
        applied = conn.execute("SELECT token, applied FROM refresh_log WHERE token >= ? "
                               "ORDER BY id", (newer - 1,)).fetchall()
        assert applied == [(newer, 1), (newer - 1, 0), (newer, 0)]
    finally:
        conn.close()


async def test_stats_app_batch_handler_refreshes_many_customers_a_call_and_stats_match(
        tmp_path: Path, namespace: str, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "stats.db"
    monkeypatch.setenv(stats_db.DB_ENV, str(db))
    stats_db.init_db(db)
    conn = stats_db.connect(db)
    try:
        stats_db.add_orders(conn, [(cid % 700, 100 + cid) for cid in range(2_000)])
        config = replace(Config.from_yaml(STATS_RULES.with_name("rules_batch.yaml")),
                         namespace=namespace)
        assert config.rules[0].batch is not None and config.rules[0].batch.max == 500
        async with Coalescer(config, redis_url=redis_url, worker=False) as c:
            c.touch_many(stats_db.KEY_FORMAT.format(cid) for cid in range(701))  # 700: none
            claims = await c.drain(timeout=60)
        assert len(claims) == 701
        assert stats_db.mismatches(conn) == {}
        assert stats_db.stored(conn)[700] == stats_db.Stats(0, 0, 0.0, None)
        assert stats_db.refreshes_since(conn, 0) == 701
        # one transaction a batch: the rows of a call share one refresh_log time
        calls = conn.execute("SELECT COUNT(DISTINCT at) FROM refresh_log").fetchone()[0]
        assert calls <= 3
    finally:
        conn.close()


def test_stats_app_refuses_a_bad_order_and_inserts_nothing(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs) -> None:
    db = tmp_path / "stats.db"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.start("app", PY, "-m", "examples.stats_app.app", "--port", str(port),
                "--redis", own_server.url, STATS_DB=str(db))
    wait_listening(procs, "app", port)
    bad = {"orders": [{"customer_id": 1, "amount": 5}, {"customer_id": "x", "amount": 1}]}
    assert http("POST", f"{url}/orders", bad) == (
        400, {"error": "orders[1].customer_id must be an integer >= 1, got 'x'"})
    status, answer = http("POST", f"{url}/orders", raw=b"\xff{")
    assert status == 400 and answer["error"].startswith("the body is not JSON")
    assert http("GET", f"{url}/customers/1/stats")[0] == 404
    conn = stats_db.connect(db)
    try:
        assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    finally:
        conn.close()
    assert http("POST", f"{url}/orders", {"customer_id": 1, "amount": 5}) == (
        201, {"inserted": 1})
    assert procs.stop("app") == 0


def test_stats_app_write_with_an_older_token_changes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "stats.db"
    stats_db.init_db(db)
    conn = stats_db.connect(db)
    try:
        stats_db.add_orders(conn, [(7, 1000), (7, 3000)])
        stale = stats_db.compute(conn, 7)           # holder of token 5 reads, then pauses
        stats_db.add_orders(conn, [(7, 5000)])
        assert stats_db.refresh(conn, 7, token=6)   # a newer claim refreshes
        fresh = stats_db.stored(conn)[7]
        assert fresh == stats_db.Stats(3, 9000, 3000.0, fresh.last_order_at)

        assert not stats_db.write_stats(conn, 7, stale, token=5)  # the stale holder resumes
        assert not stats_db.write_stats(conn, 7, stale, token=6)  # an equal token too
        assert stats_db.stored(conn)[7] == fresh
        assert stats_db.mismatches(conn) == {}
        applied = conn.execute("SELECT token, applied FROM refresh_log ORDER BY id").fetchall()
        assert applied == [(6, 1), (5, 0), (6, 0)]

        stats_db.add_orders(conn, [(7, 1)])
        assert stats_db.refresh(conn, 7, token=9)
        assert stats_db.stored(conn)[7].orders == 4
    finally:
        conn.close()


def test_stats_app_says_its_port_and_takes_it_from_the_option_first(
        own_server: ValkeyProcess, procs: Procs) -> None:
    port = free_port()
    procs.start("app", PY, "-m", "examples.stats_app.app", "--port", str(port),
                "--redis", own_server.url, PORT="1")
    wait_listening(procs, "app", port)
    assert f"the stats app listening on http://127.0.0.1:{port} (port {port}: --port)" in \
        procs.log("app")


# -- sync_app -------------------------------------------------------------------------------

SYNC_RULES = REPO / "examples" / "sync_app" / "rules.yaml"
LIKES = 120


def test_sync_app_binds_the_port_of_the_environment_else_8000(
        monkeypatch: pytest.MonkeyPatch) -> None:
    conf = REPO / "examples" / "sync_app" / "gunicorn.conf.py"
    monkeypatch.delenv("PORT", raising=False)
    assert runpy.run_path(str(conf))["bind"] == "127.0.0.1:8000"
    monkeypatch.setenv("PORT", "9123")
    assert runpy.run_path(str(conf))["bind"] == "127.0.0.1:9123"


def test_sync_app_under_gunicorn_preload_touches_from_both_workers_and_stops_cleanly(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs) -> None:
    env = {"COALESCER_REDIS_URL": own_server.url, "LIKES_DB": str(tmp_path / "likes.db")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.start("node", *node_cmd(SYNC_RULES, own_server.url), **env)
    gunicorn = procs.start(
        "gunicorn", str(Path(PY).parent / "gunicorn"), "-c", "examples/sync_app/gunicorn.conf.py",
        "--bind", f"127.0.0.1:{port}", "--workers", "2", "--preload", "--no-control-socket",
        "examples.sync_app.app:app", **env)
    wait_listening(procs, "gunicorn", port)

    def like(n: int) -> tuple[int, Any]:
        return http("POST", f"{url}/posts/{n % 40}/likes", {"user": f"u{n}"})

    with ThreadPoolExecutor(8) as pool:  # concurrent requests: both workers answer
        answers = list(pool.map(like, range(LIKES)))
    assert {status for status, _ in answers} == {201}
    workers = {answer["worker"] for _, answer in answers}
    assert len(workers) == 2 and gunicorn.pid not in workers
    assert http("POST", f"{url}/posts/1/likes", {"user": ""})[0] == 400

    def counts() -> dict[int, int | None]:
        return {post: http("GET", f"{url}/posts/{post}")[1]["likes"] for post in range(40)}
    poll_until(lambda: counts() == dict.fromkeys(range(40), LIKES // 40), timeout=15,
               message="every post's count refreshed")

    assert procs.stop("gunicorn") == 0
    log = procs.log("gunicorn")
    assert "Traceback" not in log, log
    assert log.count("coalescer closed, every touch written to Redis") == 2, log
    assert procs.stop("node") == 0


# -- webhook --------------------------------------------------------------------------------

HOOK_RULES = REPO / "examples" / "webhook" / "rules.yaml"
HOOK_SECRET = "s3cret-for-the-example-test"


def signed(body: bytes, secret: str = HOOK_SECRET, *, path: str = "/refresh/7",
           method: str = "POST", at: float | None = None) -> str:
    stamp = int(time.time() if at is None else at)
    mac = hmac.new(secret.encode(), f"{stamp}.{method}.{path}.".encode() + body,
                   hashlib.sha256)
    return f"t={stamp},v1={mac.hexdigest()}"


def post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_webhook_receiver_applies_signed_refreshes_and_refuses_forged_and_stale_ones(
        tmp_path: Path, own_server: ValkeyProcess, procs: Procs) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    text = HOOK_RULES.read_text()
    assert "http://127.0.0.1:8090/" in text
    rules = tmp_path / "rules.yaml"  # the example's rules, with the receiver's test port
    rules.write_text(text.replace("127.0.0.1:8090", f"127.0.0.1:{port}"))
    procs.start("receiver", PY, "-m", "examples.webhook.receiver", "--port", str(port),
                WEBHOOK_SECRET=HOOK_SECRET)
    procs.start("node", *node_cmd(rules, own_server.url), WEBHOOK_SECRET=HOOK_SECRET)
    wait_listening(procs, "receiver", port)

    touched = subprocess.run([PY, "-m", "coalescer.cli", "touch", "report:7", "report:8",
                              "--rules", str(rules), "--redis", own_server.url], cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=30,
                             check=False)
    assert touched.returncode == 0, touched.stderr

    def applied() -> dict[str, Any]:
        state: dict[str, Any] = http("GET", f"{url}/applied")[1]
        return state if {"report:7", "report:8"} <= state.keys() else {}
    state = poll_until(applied, timeout=15, message="both reports refreshed")
    assert {key: entry["rebuilds"] for key, entry in state.items()} == {
        "report:7": 1, "report:8": 1}
    token = state["report:7"]["token"]

    newer = json.dumps({"key": "report:7", "token": token + 100}).encode()
    good = signed(newer)
    hexed = good.split(",v1=")[1]
    forged = [{},                                              # no signature
              {"X-Coalescer-Signature": signed(newer, "another secret")},
              {"X-Coalescer-Signature": signed(newer + b" ")},   # of other bytes
              {"X-Coalescer-Signature": signed(newer, path="/refresh/8")},  # another path
              {"X-Coalescer-Signature": signed(newer, method="PUT")},
              {"X-Coalescer-Signature": signed(newer, at=time.time() - 301)},  # too old
              {"X-Coalescer-Signature": signed(newer, at=time.time() + 301)},
              {"X-Coalescer-Signature": hexed},                   # no t= part
              {"X-Coalescer-Signature": good.split(",")[0]},      # no v1= part
              {"X-Coalescer-Signature": good[:-1] + "g"},         # bad hex
              {"X-Coalescer-Signature": good[:-1] + "\u00e9"},    # non-ASCII
              {"X-Coalescer-Signature": good.replace("v1=", "v1=\u00ff")},
              {"X-Coalescer-Signature": "sha256=" + hexed},       # the old format
              {"X-Coalescer-Signature": good + ",v1=" + hexed}]   # extra parts
    for headers in forged:
        assert post_raw(f"{url}/refresh/7", newer, headers) == (
            401, {"error": "missing or wrong signature"}), headers
    stale = json.dumps({"key": "report:7", "token": token}).encode()
    assert post_raw(f"{url}/refresh/7", stale, {"X-Coalescer-Signature": signed(stale)}) == (
        200, {"key": "report:7", "token": token, "applied": False})
    assert http("GET", f"{url}/applied")[1] == state  # nothing forged or stale applied

    assert post_raw(f"{url}/refresh/7", newer, {"X-Coalescer-Signature": signed(newer)}) == (
        200, {"key": "report:7", "token": token + 100, "applied": True})
    not_json = b"{nope"
    assert post_raw(f"{url}/refresh/7", not_json,
                    {"X-Coalescer-Signature": signed(not_json)})[0] == 400
    assert "refused /refresh/7" in procs.log("receiver")
    assert procs.stop("node") == 0
    assert procs.stop("receiver") == 0


def test_webhook_receiver_will_not_start_without_its_secret(tmp_path: Path) -> None:
    done = subprocess.run([PY, "-m", "examples.webhook.receiver", "--port", str(free_port())],
                          cwd=REPO, env=clean_env(WEBHOOK_SECRET=""), capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m examples.webhook.receiver: set WEBHOOK_SECRET to the secret the node "
        "signs with"]


def test_webhook_receiver_takes_its_port_from_the_environment_and_says_so(
        procs: Procs) -> None:
    port = free_port()
    procs.start("receiver", PY, "-m", "examples.webhook.receiver", WEBHOOK_SECRET=HOOK_SECRET,
                PORT=str(port))
    wait_listening(procs, "receiver", port)
    log = procs.log("receiver")
    assert f"the webhook receiver listening on http://127.0.0.1:{port} (port {port}: $PORT)" \
        in log
    assert f"examples/webhook/rules.yaml posts to port 8090: make its url name port {port}" \
        in log  # the rules are not changed by the port
    assert procs.stop("receiver") == 0


def test_a_port_variable_that_is_no_port_is_named() -> None:
    done = subprocess.run([PY, "-m", "examples.webhook.receiver"], cwd=REPO,
                          env=clean_env(WEBHOOK_SECRET=HOOK_SECRET, PORT="http"),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "python -m examples.webhook.receiver: error: $PORT must be a port number "
        "(0 to 65535), not 'http'")
