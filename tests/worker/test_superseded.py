"""A key claimed again on the same node (its lease expired while this node was too busy
to renew it, and the shard's leader, this node, claimed it anew) supersedes the older
claim: the older run stops, is never renewed again, and the newer one is the one held."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from coalescer import Coalescer
from coalescer.store.script_types import ClaimedKey
from tests.helpers.e2e import recorder_rules
from tests.helpers.servers import wait_until

RULES = """\
namespace: {ns}
rules:
  - name: stats
    match: "stats:{{id}}"
    window: 100ms
    handler: {mod}:refresh
"""


async def test_a_newer_claim_of_a_key_stops_the_older_run_and_only_it_is_renewed(
        redis_url: str, namespace: str, tmp_path: Path) -> None:
    path, rec = recorder_rules(tmp_path, f"sup_{namespace}", RULES.format(ns=namespace,
                                                                         mod="{mod}"))
    gate = asyncio.Event()
    cancelled: list[int] = []

    async def hold(claim: Any) -> None:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.append(claim.token)
            raise

    rec.hook = hold
    async with Coalescer.from_yaml(path, redis_url=redis_url, node_id="busy") as c:
        c.touch("stats:1")
        await wait_until(lambda: len(rec.calls) == 1, message="the first run")
        first = rec.calls[0]
        node = c._run.node
        assert node is not None
        runner = node.runner
        newer = ClaimedKey(0, "stats:1", first.token + 1, first.first_touch_ms,
                           first.last_touch_ms, 2, first.due_ms)
        runner.start(0, c.config.rule("stats"), [newer], 0.0, time.monotonic())
        await wait_until(lambda: cancelled == [first.token], message="the older run stopped")
        held = runner._jobs["stats:1"]
        assert held.claim.token == first.token + 1 and not held.lost
        sent: list[Any] = []
        scripts = node.ctx.scripts
        real = scripts.renew

        async def renew(shard: Any, lease_ms: int, groups: Any) -> list[str]:
            sent.append(groups)
            return await real(shard, lease_ms, groups)

        scripts.renew = renew  # type: ignore[method-assign]
        await runner.renew_once()
        assert [[(k, t) for _, items in g for k, t in items] for g in sent] == \
            [[("stats:1", first.token + 1)]]  # the newer claim only
        gate.set()
