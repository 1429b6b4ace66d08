"""A fair rule's groups as an operator sees them, through the real paths: `coalescer
status` and `coalescer explain` run as child processes, GET /status and GET /metrics of
a node's HTTP API, on a real server with a real node holding claims.

The node runs one refresh at a time (concurrency 1) and its handler never returns, so
after its first claim call, which indexes every due key by group, the groups keep their
backlogs: 13 groups, "big" with 20 keys and weight 3, "small" with 2, and 11 of one key
each. Status keeps the 10 groups with most keys waiting and sums the other 3.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp

from coalescer import Coalescer
from coalescer.query.fair_controls import checked_change, set_fair
from coalescer.query.fair_status import OTHER, TOP
from coalescer.web.api import HttpApi
from tests.cli.test_main import cli
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
leader_lease: 10s
claim_lease: 30s
defaults: {{window: 50ms, max_wait: 1s, absorb: 5ms, concurrency: 1}}
rules:
  - name: t
    match: "t:{{org}}:{{id}}"
    handler: handlers:hold
    fair: {{by: "{{org}}", weights: {{big: 3}}, max_running: 1}}
"""

HANDLERS = """\
import asyncio


async def hold(claim):
    await asyncio.sleep(3600)
"""

KEYS = ([f"t:big:{i}" for i in range(20)] + [f"t:small:{i}" for i in range(2)]
        + [f"t:g{j}:0" for j in range(11)])
GROUPS = 13


async def backlogged(rules: Path, redis_url: str, start: Any) -> Coalescer:
    """The keys written and due, then a node that claims and holds what it claims."""
    async with Coalescer.from_yaml(rules, redis_url=redis_url, worker=False) as w:
        for key in KEYS:
            w.touch(key)
        await w.flush()

        async def due() -> bool:
            for key in KEYS:
                explained = await w.query.explain(key)
                if explained["due_ms"] > explained["now_ms"]:
                    return False
            return True
        await wait_until(due, timeout=30, interval=0.05, message="every key due")
    c: Coalescer = await start(rules, redis_url=redis_url)

    async def indexed() -> bool:
        fair = (await c.query.status())["rules"]["t"].get("fair") or {}
        rows = [*fair.get("top", []), *([fair["other"]] if fair.get("other") else [])]
        return sum(e["backlog"] + e["running"] for e in rows) == len(KEYS)
    await wait_until(indexed, timeout=30, interval=0.05,
                     message="every key indexed by group, or running")
    return c


def rows_of(fair: dict[str, Any]) -> list[dict[str, Any]]:
    return [*fair["top"], *([fair["other"]] if fair["other"] else [])]


def check_fair(fair: dict[str, Any]) -> None:
    """What a user reads off the status: the groups, the top by backlog, the rest summed,
    every key either waiting or running, shares by weight, never over the cap."""
    rows = rows_of(fair)
    assert fair["by"] == "org" and fair["cap"] == 1
    assert len(fair["top"]) == TOP
    assert fair["top"][0]["group"] == "big" and fair["top"][0]["weight"] == 3
    backlogs = [e["backlog"] for e in fair["top"]]
    assert backlogs == sorted(backlogs, reverse=True)
    assert fair["other"]["group"] == OTHER
    assert fair["other"]["groups"] == fair["groups"] - TOP
    assert fair["other"]["backlog"] <= min(backlogs) * fair["other"]["groups"]
    running = sum(e["running"] for e in rows)
    assert running == 2  # concurrency 1: one run, and one claim waiting for its slot
    assert all(e["running"] <= 1 for e in rows)  # of two groups: the cap is 1
    assert sum(e["backlog"] for e in rows) + running == len(KEYS)
    assert fair["groups"] == GROUPS
    total_weight = 3 + (fair["waiting"] - 1)
    assert abs(fair["top"][0]["share"] - 3 / total_weight) < 1e-9
    assert abs(sum(e["share"] for e in rows) - 1.0) < 1e-9


async def test_status_and_explain_show_each_groups_backlog_share_and_cap(
        rules_file: Any, namespace: str, redis_url: str, start: Any, tmp_path: Path) -> None:
    rules = rules_file(RULES.format(ns=namespace), HANDLERS)
    c = await backlogged(rules, redis_url, start)
    common = ("--rules", str(rules), "--redis", redis_url)

    done = cli("status", *common, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    check_fair(json.loads(done.stdout)["rules"]["t"]["fair"])
    text = cli("status", *common, cwd=tmp_path).stdout
    section = text[text.index("FAIR"):]
    assert re.search(r"t: by \{org\}, 1[123] groups with 31 keys waiting; max_running 1 a "
                     r"group", section), section
    big = next(line for line in section.splitlines() if line.strip().startswith("big "))
    assert re.match(r"\s+big\s+(19|20)\s+\d+%\s+3\s+[01]/1$", big), big
    assert re.search(r"\(other\) 3 groups\s+\d+", section), section

    explained = cli("explain", "t:big:5", *common, cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    line = next(x for x in explained.stdout.splitlines() if x.startswith("fair "))
    assert re.search(r"fair group: \{org\} = big: (19|20) due keys waiting, [01] running of "
                     r"1, weight 3, share \d+% of the claims \(max_running 1 a group; "
                     r"1[123] groups with keys waiting\)", line), line
    as_json = json.loads(cli("explain", "t:g3:0", *common, "--json", cwd=tmp_path).stdout)
    assert as_json["fair"]["group"]["group"] == "g3"
    assert as_json["fair"]["group"]["weight"] == 1

    api = HttpApi(c, port=0)
    await api.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(api.url + "/status") as resp:
            check_fair((await resp.json())["rules"]["t"]["fair"])
    finally:
        await api.close()


async def test_weights_and_a_cap_set_at_runtime_show_in_status(
        rules_file: Any, namespace: str, redis_url: str, start: Any) -> None:
    rules = rules_file(RULES.format(ns=namespace), HANDLERS)
    c = await backlogged(rules, redis_url, start)
    await set_fair(c.redis, c.config, "t", checked_change({"small": 6}, 2))
    fair = (await c.query.status())["rules"]["t"]["fair"]
    small = next(e for e in fair["top"] if e["group"] == "small")
    assert small["weight"] == 6 and fair["cap"] == 2
    assert fair["weights"] == {"big": 3, "small": 6}
