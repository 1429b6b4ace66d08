"""The operator's reach at scale: searching a rule's keys by capture over a million
pending keys, and a bulk retry of a million dead keys while another rule runs.

    .venv/bin/python -m bench.run --only bulk_ops_search,bulk_ops_retry

- ``search``: N pending keys of rule ``acct`` (``acct:{org}:{user}``, 1,000 orgs, 4
  shards) are written straight into the due sets; then ``Query.keys`` walks the whole
  rule for ``org=42`` a page at a time (1,000 entries a page), as ``coalescer keys
  --where org=42`` does. The figure is the server's own time (INFO commandstats usec,
  reset before the walk: the page script and nothing else runs) per 1,000 entries
  examined; also the slowest page's script time (usec per call of evalsha is an
  average: the SLOWLOG, at a 1 ms threshold, names any page over it).
- ``retry``: N dead keys of rule ``acct`` (their dead-letter state and entries written
  straight into the shards), the rule paused (its retried keys would be the herd that
  ``bench herd`` measures; here the bulk action's own cost is measured); a worker node
  runs rule ``tick``, whose keys are touched every 5 ms with a 20 ms window; then
  ``coalescer keys --rule acct --retry --yes --rate 0`` runs as a process of its own.
  Figures: keys re-queued per second (from the action's own start and end), and the
  start lag (start minus due) p99 of ``tick``'s refreshes while the retry ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coalescer import Coalescer, Config
from coalescer.query.key_search import PageSize, make_filter
from coalescer.store.keys import KeySpace

from . import common as C
from .valkey import Server

SHARDS = 4
ORGS = 1000
FILL = """
local kind, first, last, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
for i = first, last do
  local key = 'acct:' .. (i % 1000) .. ':' .. i
  if kind == 'dead' then
    redis.call('HSET', KEYS[1], key, 'D|' .. now .. '|' .. now .. '|5|bench')
    redis.call('ZADD', KEYS[2], now, key)
  else
    redis.call('ZADD', KEYS[2], now + i, key)
  end
end
return last - first + 1
"""
TICK_EVERY = 0.005  # seconds between the other rule's touches
RULES = """\
namespace: {ns}
shards: {shards}
limits: {{dead_letters: 5000000, pending_keys: 5000000}}
rules:
  - name: acct
    match: "acct:{{org}}:{{user}}"
    window: 1h
    max_wait: 2h
    handler: bench.bulk_ops:refreshed
  - name: tick
    match: "tick:{{n}}"
    window: 20ms
    max_wait: 1s
    absorb: 2ms
    handler: bench.bulk_ops:refreshed
"""


@dataclass(frozen=True)
class BulkSizes:
    """How big the figures are (full, ``quick`` and the test's ``tiny``)."""

    pending: int = 1_000_000
    dead: int = 1_000_000

    @classmethod
    def quick(cls) -> BulkSizes:
        return cls(pending=200_000, dead=200_000)

    @classmethod
    def tiny(cls) -> BulkSizes:
        return cls(pending=2_000, dead=2_000)


def sizes_of(sizes: C.Sizes) -> BulkSizes:
    """The bulk ops sizes of a run (see common.module_sizes)."""
    return C.module_sizes(sizes, "bulk_ops", BulkSizes)


LAGS: list[float] = []  # tick's start lags, ms (this host's clock, offset to the server's)
OFFSET = [0.0]


async def refreshed(claim: Any) -> None:
    if claim.rule == "tick":
        LAGS.append(time.time() * 1000 + OFFSET[0] - claim.due_ms)


def _config(namespace: str) -> Config:
    return Config.from_string(RULES.format(ns=namespace, shards=SHARDS), source="<bench>")


def fill(server: Server, namespace: str, kind: str, n: int) -> None:
    """``n`` keys split evenly over the shards' sets (index ranges per shard)."""
    client = server.client(timeout=120)
    try:
        script = client.register_script(FILL)
        space = KeySpace(namespace, SHARDS)
        now = int(time.time() * 1000) + (3_600_000 if kind == "pending" else 0)
        per = -(-n // SHARDS)
        for shard in range(SHARDS):
            sk = space.shard(shard)
            target = sk.dead("acct") if kind == "dead" else sk.due("acct")
            lo, hi = shard * per, min(n, (shard + 1) * per)
            for first in range(lo, hi, 20_000):
                script(keys=[sk.meta, target],
                       args=[kind, first, min(hi, first + 20_000) - 1, now])
    finally:
        client.close()


def _server_usec(server: Server) -> tuple[int, int]:
    """(usec, calls) of every command run since the last CONFIG RESETSTAT, INFO and
    CONFIG left out."""
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    usec = calls = 0
    for name, entry in stats.items():
        if name.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_slowlog")):
            continue
        usec += int(entry["usec"])
        calls += int(entry["calls"])
    return usec, calls


async def search(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    n = sizes_of(sizes).pending
    namespace = "bulkops"
    fill(server, namespace, "pending", n)
    admin = server.client()
    admin.config_set("slowlog-log-slower-than", 1000)
    admin.slowlog_reset()
    async with Coalescer(_config(namespace), redis_url=server.url, worker=False) as c:
        wanted = make_filter(c.config, "acct", where=["org=42"])
        await c.query.keys(wanted, None, PageSize(scan=10, limit=10))  # scripts loaded
        admin.config_resetstat()
        found = examined = pages = 0
        cursor: str | None = None
        t0 = time.monotonic()
        while True:
            page = await c.query.keys(wanted, cursor, PageSize(scan=1000, limit=1000))
            found += len(page.keys)
            examined += page.examined
            pages += 1
            cursor = page.cursor
            if cursor is None:
                break
        wall = time.monotonic() - t0
    usec, calls = _server_usec(server)
    slow = admin.slowlog_len()  # page calls over 1 ms (only the search ran)
    admin.close()
    return {"pending": n, "found": found, "examined": examined, "pages": pages,
            "server_usec": usec, "calls": calls, "wall_s": wall,
            "us_per_1000": usec * 1000 / max(1, examined),
            "pages_over_1ms": slow}


async def retry(server: Server, sizes: C.Sizes) -> dict[str, Any]:
    n = sizes_of(sizes).dead
    namespace = "bulkretry"
    fill(server, namespace, "dead", n)
    OFFSET[0] = await C.clock_offset_ms(server.url)
    with tempfile.TemporaryDirectory() as folder:
        rules = Path(folder) / "rules.yaml"
        rules.write_text(RULES.format(ns=namespace, shards=SHARDS))
        async with Coalescer(_config(namespace).with_handlers(), redis_url=server.url,
                             node_id="bench-node") as c:
            await c.query.pause("acct")
            stop = asyncio.Event()
            ticking = asyncio.create_task(_tick(c, stop))
            await asyncio.sleep(1.0 if n >= 100_000 else 0.2)  # the other rule running
            LAGS.clear()
            done = await _bulk_retry(server.url, rules)
            lags = list(LAGS)
            stop.set()
            await ticking
            left = (await c.query.status())["rules"]["acct"]["dead"]
    per_second = done["done"] / max(1e-9, (done["ended_ms"] - done["started_ms"]) / 1000)
    return {"dead": n, "done": done["done"], "left_dead": left, "per_second": per_second,
            "seconds": (done["ended_ms"] - done["started_ms"]) / 1000,
            "tick_lag": C.percentiles(lags)}


async def _tick(c: Coalescer, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        c.touch(f"tick:{i % 1000}")
        i += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), TICK_EVERY)


async def _bulk_retry(url: str, rules: Path) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "coalescer.cli", "keys", "--rules", str(rules), "--redis", url,
        "--rule", "acct", "--retry", "--yes", "--rate", "0", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the bulk retry failed: {err.decode()[-2000:]}")
    found: dict[str, Any] = json.loads(out)
    return found


# -- the table's rows ---------------------------------------------------------------------


def _us(v: float) -> str:
    return f"{v:,.0f} µs"


def _ms(v: float) -> str:
    return f"{v:,.1f} ms"


def _rate(v: float) -> str:
    return f"{v / 1000:.3g}k" if v >= 1000 else f"{v:.3g}"


def rows(t: Any) -> None:
    """The rows of the bulk_ops groups in ``bench.run``'s table (no baseline: the
    hand-rolled ZSET poller has no search and no bulk action)."""
    bs = sizes_of(t.sizes)
    t.figure(f"keys --where over {bs.pending:,} pending keys: server time per 1,000 "
             "entries examined", t.spread("bulk_ops_search.coalescer", "us_per_1000"), None,
             fmt=_us, target="≤ 1,000 µs", ok=lambda v: v <= 1000)
    t.figure(f"bulk retry of {bs.dead:,} dead keys (coalescer keys --retry --rate 0), "
             "keys/s", t.spread("bulk_ops_retry.coalescer", "per_second"), None,
             fmt=_rate, target="≥ 50k", ok=lambda v: v >= 50_000)
    t.figure("another rule's start lag p99 while the bulk retry runs",
             t.spread("bulk_ops_retry.coalescer", "tick_lag.p99"), None, fmt=_ms,
             target="≤ 20 ms", ok=lambda v: v <= 20)
