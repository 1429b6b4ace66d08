"""A pause holds for a rule the leader lacks, served by the node that knows it (a
rolling deploy): that node's adopter claims none of its keys until it is resumed.

Two in-process nodes on a real valkey-server, as in test_rolling: B leads and knows
only ``item``; A also knows ``only-a`` and ``also-a``, whose keys it adopts.
"""

from __future__ import annotations

from coalescer import Coalescer
from tests.helpers.servers import wait_until
from tests.worker.test_rolling import (  # noqa: F401 (start: a fixture)
    ITEM,
    ONLY_A,
    Node,
    RulesFactory,
    Start,
    start,
    text,
)

ALSO_A = """\
  - name: also-a
    match: "x:{id}"
    handler: handlers:refresh
"""


def paused_gauge(node: Coalescer, rule: str) -> float | None:
    return node.metrics.registry.get_sample_value("coalescer_rule_paused", {"rule": rule})


async def test_an_adopted_rule_that_is_paused_runs_nothing_until_resumed(
        rules_file: RulesFactory, namespace: str, start: Start) -> None:  # noqa: F811
    node_b = Node(rules_file, text(namespace, 1, ITEM))
    node_a = Node(rules_file, text(namespace, 1, ITEM, ONLY_A, ALSO_A))
    b = await start(node_b, "B")
    await wait_until(lambda: b.leads() == [0], message="B leads")
    a = await start(node_a, "A")
    assert await a.query.pause("only-a") is True
    await wait_until(lambda: paused_gauge(a, "only-a") == 1, message="A heard of the pause")

    paused_keys = [f"a:{n}" for n in range(4)]
    a.touch_many(paused_keys)
    await a.flush()
    a.touch("x:1")  # adopted too, due after them, in the same adopt calls
    await a.flush()
    await wait_until(lambda: [c.key for c in node_a.rec.succeeded] == ["x:1"], timeout=20,
                     message="A refreshes x:1")
    assert [c.key for c in node_a.rec.calls] == ["x:1"]

    await b.query.resume("only-a")
    await wait_until(lambda: {c.key for c in node_a.rec.succeeded} >= set(paused_keys),
                     timeout=20, message="A refreshes the keys once resumed")
    assert sorted(c.key for c in node_a.rec.calls) == sorted([*paused_keys, "x:1"])
