"""The outbox on a real PostgreSQL server (bench.postgres), through one node in process.

``outbox_throughput``: N rows (distinct keys) already in the outbox table; a node
starts, and touches/s is N over the time from its start to the last row's touch in
Redis (the node's accepted counter reaching N; its start-up counts against it).

``outbox_lag``: a writer process commits one row a transaction at 1,000 commits/s for
a few seconds, noting when each commit returned; the node, woken by LISTEN/NOTIFY,
touches them. Redis stamps each key's due time with its own clock at the write
(due = write time + the window, an hour here), so commit -> Redis is that write time
minus the commit time (one machine, one clock), per row: p50, p99, max.

``outbox_cost``: what a touch adds to a transaction. The same writer runs N
transactions of one ``INSERT`` into an orders table, with and without
``touch_in_transaction`` of one key (one more ``INSERT``, into the outbox, and its
NOTIFY), through SQLAlchemy sessions, the kinds in turn; the difference of the medians
of one transaction's time, in microseconds. Beside it, the same into a table created
with ``notify=False`` (no trigger: the nodes find its rows by polling).

The server runs with ``fsync`` on (``durable``) for the throughput and the cost, as a
production server does; the lag's 1,000 commits/s from one connection need each commit
to return within a millisecond, so its server runs with ``synchronous_commit`` off
(``fsync=off``), which is said beside the figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.orm import Session

from coalescer import Coalescer, Config
from coalescer.integrations.sqlalchemy import outbox_table, touch_in_transaction
from coalescer.store.keys import KeySpace

from . import common as C
from .postgres import PostgresServer
from .valkey import Server

TABLE = "coalescer_outbox"
QUIET = "coalescer_outbox_quiet"  # no NOTIFY trigger: nodes find its rows by polling
WINDOW_MS = 3_600_000
LAG_RATE = 1000  # commits/s


def rules(url: str, poll: str = "1s") -> Config:
    text_ = C.rules_text(window="1h", max_wait="1h", handler="builtins:repr")
    text_ += f"sources:\n  - {{name: outbox, type: outbox, url: '{url}', poll: {poll}}}\n"
    return Config.from_string(text_, source="<bench>")


def prepare(server: PostgresServer) -> None:
    engine = create_engine(server.url.replace("postgresql://", "postgresql+psycopg://"))
    metadata = MetaData()
    outbox_table(metadata, TABLE)
    outbox_table(metadata, QUIET, notify=False)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text)"))
    engine.dispose()


@contextlib.contextmanager
def _postgres(durable: bool) -> Iterator[PostgresServer]:
    """A fresh PostgreSQL server with the bench's tables, stopped afterwards."""
    pg = PostgresServer(durable=durable).start()
    try:
        pg.wait_ready()
        prepare(pg)
        yield pg
    finally:
        pg.close()


def accepted(c: Coalescer) -> float:
    value = c.metrics.registry.get_sample_value(
        "coalescer_source_entries_total", {"source": "outbox", "outcome": "accepted"})
    return value or 0.0


async def outbox_throughput(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    n = 200_000 if sizes.drain_keys >= 50_000 else 50_000
    with _postgres(durable=True) as pg:
        engine = create_engine(pg.url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO {TABLE} (key) SELECT 'stats:user:' || i "
                              "FROM generate_series(1, :n) AS i"), {"n": n})
        engine.dispose()
        t0 = time.perf_counter()
        async with Coalescer(rules(pg.url), redis_url=server.url, node_id="bench") as c:
            deadline = time.monotonic() + 120
            while accepted(c) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            seconds = time.perf_counter() - t0
            done = accepted(c)
        pending = await _pending(server, n)
    return {"rows": n, "touched": done, "pending_in_redis": pending, "seconds": seconds,
            "per_second": done / seconds, "lost": n - pending, "touches": n}


async def _pending(server: Server, n: int) -> int:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(server.url)
    try:
        return int(await client.zcard(KeySpace(C.NS, 1).shard(0).due(C.RULE)))
    finally:
        await client.aclose()


async def outbox_lag(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    seconds = sizes.lag_seconds
    n = int(LAG_RATE * seconds)
    out = tmp / f"outbox-lag-{time.monotonic_ns()}.json"
    with _postgres(durable=False) as pg:
        async with Coalescer(rules(pg.url), redis_url=server.url, node_id="bench") as c:
            await asyncio.sleep(0.5)  # the node listens
            writer = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.outbox", "write", pg.url, str(n), str(LAG_RATE),
                str(out), cwd=Path(__file__).resolve().parents[1])
            await writer.wait()
            deadline = time.monotonic() + 60
            while accepted(c) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            lags = await _lags(server, json.loads(out.read_text()))
    lags.sort()
    achieved = n / max(1e-9, json.loads(out.read_text())["seconds"])
    return {"commits": n, "commits_per_second": achieved, "touched": len(lags),
            "p50": statistics.median(lags), "p99": lags[int(len(lags) * 0.99) - 1],
            "max": lags[-1], "lost": n - len(lags), "touches": n}


async def _lags(server: Server, written: dict[str, Any]) -> list[float]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        scored = await client.zrange(KeySpace(C.NS, 1).shard(0).due(C.RULE), 0, -1,
                                     withscores=True)
        due = dict(cast("list[tuple[str, float]]", scored))
    finally:
        await client.aclose()
    commits: dict[str, float] = written["commits"]
    return [due[key] - WINDOW_MS - at_ms for key, at_ms in commits.items() if key in due]


def write(url: str, n: int, rate: int, out: str) -> None:
    """The lag's writer: ``n`` transactions of one outbox row, paced at ``rate``/s."""
    import psycopg

    commits: dict[str, float] = {}
    with psycopg.connect(url) as conn:
        t0 = time.perf_counter()
        for i in range(n):
            ahead = t0 + i / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            key = f"stats:user:{i}"
            conn.execute(f"INSERT INTO {TABLE} (key) VALUES (%s)", (key,))
            conn.commit()
            commits[key] = time.time() * 1000
        seconds = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"commits": commits, "seconds": seconds}))


async def outbox_cost(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    n = 3000 if sizes.drain_keys >= 50_000 else 1000
    with _postgres(durable=True) as pg:
        result = await asyncio.to_thread(_cost, pg.url, n)
    return result


def _cost(url: str, n: int) -> dict[str, Any]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    tables = {"touch": outbox_table(MetaData(), TABLE),
              "touch_quiet": outbox_table(MetaData(), QUIET, notify=False)}
    times: dict[str, list[float]] = {"plain": [], "touch": [], "touch_quiet": []}
    kinds = list(times)
    try:
        for i in range(n):  # the kinds in turn, so drift hits them alike
            for kind in kinds[i % 3:] + kinds[:i % 3]:
                t0 = time.perf_counter()
                with Session(engine) as session:
                    session.execute(text("INSERT INTO orders (customer) VALUES (:c)"),
                                    {"c": str(i)})
                    if kind != "plain":
                        touch_in_transaction(session, f"stats:user:{i}", table=tables[kind])
                    session.commit()
                times[kind].append((time.perf_counter() - t0) * 1e6)
    finally:
        engine.dispose()
    plain, touch, quiet = (statistics.median(times[k]) for k in kinds)
    return {"transactions": n, "plain_us": plain, "touch_us": touch,
            "added_us": touch - plain, "added_percent": (touch / plain - 1) * 100,
            "touch_quiet_us": quiet, "added_quiet_us": quiet - plain}


KILLED_WRITERS = 30


async def outbox_kills(server: Server, sizes: C.Sizes, tmp: Path) -> dict[str, Any]:
    """30 writer processes commit a row and are SIGKILLed the moment their commit
    returns, with the outbox (PostgreSQL) and with ``touch_after_commit`` (SQLite, a
    ``SyncCoalescer``); touches lost = writers - keys Redis holds once a node has read
    the outbox (the after-commit writers wrote to Redis themselves, or not at all)."""
    with _postgres(durable=True) as pg:
        outbox = _killed(lambda n: _commit_outbox(pg.url, n))
        async with Coalescer(rules(pg.url, "50ms"), redis_url=server.url, node_id="bench") as c:
            deadline = time.monotonic() + 60
            while accepted(c) < KILLED_WRITERS and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        outbox_held = await _pending(server, KILLED_WRITERS)
    db = tmp / f"after-commit-{time.monotonic_ns()}.db"
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (customer TEXT)"))
    engine.dispose()
    config_path = tmp / f"after-commit-{time.monotonic_ns()}.yaml"
    config_path.write_text(C.rules_text(window="1h", max_wait="1h", handler="builtins:repr"))
    _killed(lambda n: _commit_after(db, config_path, server.url, n))
    after_held = await _pending(server, KILLED_WRITERS) - outbox_held
    return {"writers": KILLED_WRITERS, "outbox_killed": outbox,
            "outbox": {"lost": KILLED_WRITERS - outbox_held, "touches": KILLED_WRITERS},
            "after_commit": {"lost": KILLED_WRITERS - after_held, "touches": KILLED_WRITERS}}


def _killed(body: Any) -> int:
    """Fork KILLED_WRITERS writers running ``body(n)``, each SIGKILLing itself once it
    returns; how many died by SIGKILL."""
    pids = []
    for n in range(KILLED_WRITERS):
        pid = os.fork()
        if pid == 0:
            try:
                body(n)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        pids.append(pid)
    return sum(os.waitpid(pid, 0)[1] == signal.SIGKILL for pid in pids)


def _commit_outbox(url: str, n: int) -> None:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    table = outbox_table(MetaData(), TABLE)
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders (customer) VALUES (:c)"), {"c": str(n)})
        touch_in_transaction(session, f"stats:user:k{n}", table=table)
        session.commit()


def _commit_after(db: Path, rules_path: Path, redis_url: str, n: int) -> None:
    from coalescer import SyncCoalescer
    from coalescer.integrations.sqlalchemy import touch_after_commit

    engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": 30})
    with SyncCoalescer.from_yaml(rules_path, redis_url=redis_url) as c, Session(engine) as s:
        s.execute(text("INSERT INTO orders VALUES (:c)"), {"c": str(n)})
        touch_after_commit(s, c, f"stats:user:a{n}")
        s.commit()
        os.kill(os.getpid(), signal.SIGKILL)  # before the context's clean flush


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
