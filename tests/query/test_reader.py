"""``Coalescer.query``: every read goes through the coalescer's connection of the moment."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalescer import ClosedError, Coalescer
from tests.helpers.inspection import fast_rules, node, write


async def test_reads_before_start_say_the_coalescer_is_not_connected(
        tmp_path: Path, namespace: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    c = Coalescer.from_yaml(rules, worker=False)
    for call in (c.query.status(), c.query.explain("ok:1"), c.query.history(),
                 c.query.next_due(), c.query.dead_letters(), c.query.retry_dead(),
                 c.query.purge_dead(["ok:1"])):
        with pytest.raises(ClosedError, match="not connected"):
            await call


async def test_query_reads_and_retries_through_the_running_coalescer(
        tmp_path: Path, namespace: str, redis_url: str) -> None:
    rules, _ = write(tmp_path, namespace, fast_rules(namespace))
    async with node(rules, redis_url, worker=False) as c:
        query = c.query
        c.touch("ok:1")
        await c.flush()
        assert (await query.status())["rules"]["ok"]["pending"] == 1
        outcome = await query.retry_dead(["ok:1"])
        assert (outcome.done, outcome.not_dead) == (0, ["ok:1"])
    assert c.query is query
