"""A node's poller with a fair rule, end to end on a real server: a tenant's import does
not hold a quiet tenant's refresh behind it (and does without ``fair``), and a cap on a
tenant's runs holds across three racing node processes, counted from outside."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

from coalescer import Claim
from tests.cli.test_main import cli
from tests.conftest import Start
from tests.helpers.e2e import NodeProcs, recorder_rules
from tests.helpers.servers import poll_until, wait_until

RULES = """\
namespace: {ns}
defaults:
  window: 50ms
  max_wait: 1s
  absorb: 5ms
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    handler: {{mod}}:refresh
    concurrency: 4
    {fair}
"""


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "due-order"])
async def test_a_quiet_tenant_is_refreshed_soon_behind_another_tenants_import(
        tmp_path: Path, namespace: str, redis_url: str, start: Start, fair: bool) -> None:
    text = RULES.format(ns=namespace, fair='fair: {by: "{org}"}' if fair else "")
    path, rec = recorder_rules(tmp_path, f"fairnode_{namespace}_{fair}", text)

    async def slow(claim: Claim) -> None:
        await asyncio.sleep(0.005)
    rec.hook = slow
    c = await start(path, redis_url=redis_url, worker=True)
    for i in range(300):
        c.touch(f"t:import:{i}")
    await c.flush()
    c.touch("t:quiet:1")
    await c.flush()
    await wait_until(lambda: len(rec.succeeded) == 301, timeout=30,
                     message="every key refreshed")

    place = [claim.key for claim in rec.calls].index("t:quiet:1")
    if fair:
        assert place < 60, place  # within a few claim calls of its due time
    else:
        assert place == 300  # behind the whole import


LINE_HANDLER = """\
import asyncio
import os


def _line(*parts):
    with open(os.environ["E2E_LOG"], "a") as f:
        f.write(" ".join(str(p) for p in parts) + "\\n")


async def refresh(claim):
    _line("start", claim.key, claim.token)
    await asyncio.sleep(0.01)
    _line("done", claim.key, claim.token)
"""

CAP_RULES = """\
namespace: {ns}
shards: 6
leader_lease: 1s
claim_lease: 2s
defaults:
  window: 10ms
  max_wait: 1s
  absorb: 2ms
rules:
  - name: tenants
    match: "t:{{org}}:{{id}}"
    handler: {mod}:refresh
    concurrency: 16
    fair: {{by: "{{org}}", max_running: 3}}
"""


def most_at_once(log: Path) -> tuple[dict[str, int], int]:
    """Per tenant, the most runs between a start and its done line at once, read in the
    order the lines were appended; and how many runs finished."""
    running: dict[str, int] = defaultdict(int)
    most: dict[str, int] = defaultdict(int)
    done = 0
    for line in log.read_text().splitlines():
        phase, key, _ = line.split()
        org = key.split(":")[1]
        if phase == "start":
            running[org] += 1
            most[org] = max(most[org], running[org])
        else:
            running[org] -= 1
            done += 1
    return dict(most), done


@pytest.mark.slow
def test_a_cap_is_never_exceeded_by_three_racing_nodes(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    module = f"cap_{namespace}"
    (tmp_path / f"{module}.py").write_text(LINE_HANDLER)
    rules = tmp_path / "rules.yaml"
    rules.write_text(CAP_RULES.format(ns=namespace, mod=module))
    log = tmp_path / "lines.log"
    procs = NodeProcs(tmp_path)
    try:
        for node in ("n1", "n2", "n3"):
            procs.start(rules, redis_url, node, E2E_LOG=str(log))
        keys = [f"t:{org}:{i}" for org in ("a", "b") for i in range(150)]
        for i in range(0, len(keys), 100):
            done = cli("touch", *keys[i:i + 100], "--rules", str(rules), "--redis",
                       redis_url, cwd=tmp_path)
            assert done.returncode == 0, done.stderr
        poll_until(lambda: log.exists() and most_at_once(log)[1] == 300, timeout=60,
                   message="every key refreshed")
    finally:
        procs.stop_all()
    most, _ = most_at_once(log)
    assert most == {"a": 3, "b": 3}  # reached, and never more
